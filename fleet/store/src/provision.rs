//! Who creates the fleet's JetStream resources. Fronts (and `fleet up`) **create** every bucket and stream, or
//! update it to the settings; workers and operator tooling only **attach** to what a front created — their NATS
//! users may not create, update or delete streams (the role table of the fleet crate's `nats_auth::permissions`), so a stolen worker
//! credential cannot shrink a stream's retention or drop it. An attaching process started before any front waits
//! for the resources (up to [`ATTACH_WAIT`]), then fails naming the missing one.

use std::time::{Duration, Instant};

use async_nats::jetstream::{self, kv, object_store, stream};

/// A boxed source error (async-nats errors, I/O).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// How long an attaching process waits for a front to create a resource.
pub const ATTACH_WAIT: Duration = Duration::from_secs(60);

/// How often it looks again meanwhile.
const ATTACH_POLL: Duration = Duration::from_millis(250);

/// Whether a process creates the resources it uses or attaches to existing ones.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Provision {
    /// Create, or update to the settings (fronts, `fleet up`).
    #[default]
    Create,
    /// Use what exists, waiting for it when missing (workers, operator tooling).
    Attach,
}

/// Why a resource could not be created or attached.
#[derive(Debug, thiserror::Error)]
pub enum ProvisionError {
    /// Creating or updating it failed.
    #[error("creating {resource}: {source}")]
    Create {
        /// The bucket or stream.
        resource: String,
        /// The cause.
        #[source]
        source: BoxError,
    },
    /// It does not exist, and no front created it in time.
    #[error(
        "{resource} does not exist after {}s: start a front first (fronts create the fleet's JetStream resources)",
        waited.as_secs()
    )]
    Missing {
        /// The bucket or stream.
        resource: String,
        /// How long it was waited for.
        waited: Duration,
    },
    /// Reading it failed.
    #[error("opening {resource}: {source}")]
    Open {
        /// The bucket or stream.
        resource: String,
        /// The cause.
        #[source]
        source: BoxError,
    },
}

/// How long a front waits for a cluster that cannot create a resource yet — it cannot place the replicas ("no
/// suitable peers for placement": a NATS cluster still forming, or a node restarting that the meta leader has not
/// seen back), or its JetStream API does not answer (the meta group electing a leader) — the same bound as an
/// attaching process's wait for a front.
pub const PLACEMENT_WAIT: Duration = ATTACH_WAIT;

/// Whether `e` (or an error it wraps) says the cluster cannot create a resource *for now*:
/// * JetStream's "no suitable peers for placement" (`10005`): not enough cluster peers are online for the
///   replicas asked;
/// * "JetStream system temporarily unavailable" (`10008`), or no answer at all — the request timed out or found
///   no responder: only the meta leader answers a create, and a cluster's meta group may elect (again) just
///   after its servers report healthy, for a whole Raft election timeout (4–9 s in nats-server).
///
/// Creating again is safe: a create that was applied although its answer never came is found and updated to
/// the same settings.
fn placement_pending(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(e);
    while let Some(e) = next {
        if pending_here(e) {
            return true;
        }
        next = e.source();
    }
    false
}

/// [`placement_pending`] for one error of the chain, by its type: one downcast each, its JetStream code and its
/// kind read together.
fn pending_here(e: &(dyn std::error::Error + 'static)) -> bool {
    use jetstream::ErrorCode;
    use jetstream::context::{
        AccountError, AccountErrorKind, CreateKeyValueError, CreateKeyValueErrorKind, CreateStreamError,
        CreateStreamErrorKind, RequestError, RequestErrorKind,
    };
    let placement = |code: ErrorCode| {
        matches!(
            code,
            ErrorCode::CLUSTER_NO_PEERS | ErrorCode::CLUSTER_NOT_AVAILABLE
        )
    };
    if let Some(j) = e.downcast_ref::<jetstream::Error>() {
        return placement(j.error_code());
    }
    if let Some(c) = e.downcast_ref::<CreateStreamError>() {
        return match c.kind() {
            CreateStreamErrorKind::JetStream(j) => placement(j.error_code()),
            CreateStreamErrorKind::TimedOut | CreateStreamErrorKind::JetStreamUnavailable => true,
            _ => false,
        };
    }
    if let Some(a) = e.downcast_ref::<AccountError>() {
        return match a.kind() {
            AccountErrorKind::JetStream(j) => j.error_code() == ErrorCode::CLUSTER_NOT_AVAILABLE,
            AccountErrorKind::TimedOut | AccountErrorKind::JetStreamUnavailable => true,
            AccountErrorKind::Other => false,
        };
    }
    if let Some(c) = e.downcast_ref::<CreateKeyValueError>() {
        return c.kind() == CreateKeyValueErrorKind::TimedOut;
    }
    if let Some(r) = e.downcast_ref::<RequestError>() {
        return matches!(
            r.kind(),
            RequestErrorKind::TimedOut | RequestErrorKind::NoResponders
        );
    }
    e.downcast_ref::<async_nats::RequestError>().is_some_and(|r| {
        matches!(
            r.kind(),
            async_nats::RequestErrorKind::TimedOut | async_nats::RequestErrorKind::NoResponders
        )
    })
}

/// Runs `create` until it succeeds, fails otherwise than [`placement_pending`], or [`PLACEMENT_WAIT`] passed.
async fn creating<T, E, F, Fut>(resource: &str, mut create: F) -> Result<T, ProvisionError>
where
    E: std::error::Error + Send + Sync + 'static,
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
{
    let started = Instant::now();
    let mut told = false;
    loop {
        match create().await {
            Ok(v) => return Ok(v),
            Err(e) if placement_pending(&e) && started.elapsed() < PLACEMENT_WAIT => {
                if !told {
                    told = true;
                    tracing::info!(
                        resource,
                        error = %e,
                        "waiting for the NATS cluster to create a JetStream resource"
                    );
                }
                tokio::time::sleep(ATTACH_POLL).await;
            }
            Err(e) => {
                return Err(ProvisionError::Create {
                    resource: resource.to_owned(),
                    source: e.into(),
                });
            }
        }
    }
}

/// Waits until the stream `name` exists (at most [`ATTACH_WAIT`]).
async fn wait_for_stream(js: &jetstream::Context, name: &str, resource: &str) -> Result<(), ProvisionError> {
    let started = Instant::now();
    loop {
        match js.get_stream(name).await {
            Ok(_) => return Ok(()),
            Err(e) => {
                let missing = matches!(
                    e.kind(),
                    jetstream::context::GetStreamErrorKind::JetStream(j)
                        if j.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND
                );
                if !missing {
                    return Err(ProvisionError::Open {
                        resource: resource.to_owned(),
                        source: e.into(),
                    });
                }
            }
        }
        if started.elapsed() >= ATTACH_WAIT {
            return Err(ProvisionError::Missing {
                resource: resource.to_owned(),
                waited: ATTACH_WAIT,
            });
        }
        if started.elapsed() < ATTACH_POLL {
            tracing::info!(resource, "waiting for a front to create a JetStream resource");
        }
        tokio::time::sleep(ATTACH_POLL).await;
    }
}

/// The KV bucket of `config`: created or updated, or attached.
pub async fn key_value(
    js: &jetstream::Context,
    config: kv::Config,
    provision: Provision,
) -> Result<kv::Store, ProvisionError> {
    let bucket = config.bucket.clone();
    match provision {
        Provision::Create => {
            creating(&bucket, || {
                Box::pin(js.create_or_update_key_value(config.clone()))
            })
            .await
        }
        Provision::Attach => {
            wait_for_stream(js, &format!("KV_{bucket}"), &bucket).await?;
            js.get_key_value(bucket.clone())
                .await
                .map_err(|e| ProvisionError::Open {
                    resource: bucket,
                    source: e.into(),
                })
        }
    }
}

/// The stream of `config`: created or updated, or attached.
pub async fn stream(
    js: &jetstream::Context,
    config: stream::Config,
    provision: Provision,
) -> Result<stream::Stream, ProvisionError> {
    let name = config.name.clone();
    if provision == Provision::Create {
        creating(&name, || Box::pin(js.create_or_update_stream(config.clone()))).await?;
    } else {
        wait_for_stream(js, &name, &name).await?;
    }
    Box::pin(js.get_stream(&name))
        .await
        .map_err(|e| ProvisionError::Open {
            resource: name,
            source: e.into(),
        })
}

/// The object store of `config`: created when missing, or attached.
pub async fn object_store(
    js: &jetstream::Context,
    config: object_store::Config,
    provision: Provision,
) -> Result<object_store::ObjectStore, ProvisionError> {
    let bucket = config.bucket.clone();
    if provision == Provision::Attach {
        wait_for_stream(js, &format!("OBJ_{bucket}"), &bucket).await?;
    }
    match js.get_object_store(&bucket).await {
        Ok(s) if provision == Provision::Create => {
            cap_object_store(js, &bucket, config.max_bytes).await?;
            Ok(s)
        }
        Ok(s) => Ok(s),
        Err(e) if provision == Provision::Attach => Err(ProvisionError::Open {
            resource: bucket,
            source: e.into(),
        }),
        Err(_) => match creating(&bucket, || js.create_object_store(config.clone())).await {
            Ok(s) => Ok(s),
            // Another process created it in between.
            Err(e) => js.get_object_store(&bucket).await.map_err(|_| e),
        },
    }
}

/// Sets an existing object store's `max_bytes` to `max_bytes` (≤ 0: none) when it differs: the one setting of an
/// object store updated after its creation (a budget given or changed later caps the buckets it sizes).
async fn cap_object_store(
    js: &jetstream::Context,
    bucket: &str,
    max_bytes: i64,
) -> Result<(), ProvisionError> {
    let update = |e: BoxError| ProvisionError::Create {
        resource: bucket.to_owned(),
        source: e,
    };
    let want = if max_bytes > 0 { max_bytes } else { -1 };
    let mut stream = js
        .get_stream(format!("OBJ_{bucket}"))
        .await
        .map_err(|e| update(e.into()))?;
    let mut config = stream.info().await.map_err(|e| update(e.into()))?.config.clone();
    if config.max_bytes == want {
        return Ok(());
    }
    config.max_bytes = want;
    js.update_stream(config).await.map_err(|e| update(e.into()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api_error(err_code: u64) -> jetstream::Error {
        serde_json::from_value(serde_json::json!({
            "code": 400,
            "err_code": err_code,
            "description": "from the JetStream API",
        }))
        .unwrap_or_else(|e| panic!("a JetStream API error: {e}"))
    }

    fn create_error(err_code: u64) -> jetstream::context::CreateStreamError {
        jetstream::context::CreateStreamError::new(jetstream::context::CreateStreamErrorKind::JetStream(
            api_error(err_code),
        ))
    }

    /// "No suitable peers for placement" (a NATS cluster still forming, seen once at a `fleet up --nats-cluster
    /// 3` start) is waited out, as the stream or wrapped in a bucket's error; anything else fails at once.
    #[tokio::test]
    async fn creation_waits_out_a_cluster_that_cannot_place_replicas_yet() {
        assert!(placement_pending(&create_error(10005)));
        assert!(placement_pending(&api_error(10005)));
        let wrapped = jetstream::context::CreateKeyValueError::with_source(
            jetstream::context::CreateKeyValueErrorKind::BucketCreate,
            create_error(10005),
        );
        assert!(placement_pending(&wrapped));
        assert!(!placement_pending(&create_error(10058)));
        // No answer from the meta leader, as `create_or_update_key_value` and `create_stream` report it.
        assert!(placement_pending(&create_error(10008)));
        let timed_out = || {
            jetstream::context::CreateStreamError::from(jetstream::context::RequestError::new(
                jetstream::context::RequestErrorKind::TimedOut,
            ))
        };
        assert!(placement_pending(&timed_out()));
        assert!(placement_pending(
            &jetstream::context::CreateKeyValueError::with_source(
                jetstream::context::CreateKeyValueErrorKind::JetStream,
                timed_out(),
            )
        ));
        assert!(placement_pending(&jetstream::context::CreateStreamError::from(
            jetstream::context::RequestError::new(jetstream::context::RequestErrorKind::NoResponders)
        )));
        // `create_or_update_key_value` asks for the account's limits first: that request goes unanswered too.
        assert!(placement_pending(
            &jetstream::context::CreateKeyValueError::with_source(
                jetstream::context::CreateKeyValueErrorKind::JetStream,
                jetstream::context::AccountError::new(jetstream::context::AccountErrorKind::TimedOut),
            )
        ));
        assert!(!placement_pending(&jetstream::context::CreateStreamError::new(
            jetstream::context::CreateStreamErrorKind::InvalidStreamName
        )));

        let mut attempts = 0;
        let created = creating("s", || {
            attempts += 1;
            let n = attempts;
            async move { if n < 3 { Err(create_error(10005)) } else { Ok(n) } }
        })
        .await;
        assert_eq!(created.ok(), Some(3), "created at the third attempt");

        let mut attempts = 0;
        let refused = creating("s", || {
            attempts += 1;
            async { Err::<(), _>(create_error(10058)) }
        })
        .await;
        assert!(matches!(refused, Err(ProvisionError::Create { .. })));
        assert_eq!(attempts, 1, "another error is not retried");
    }
}
