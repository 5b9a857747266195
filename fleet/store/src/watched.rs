//! The one loop behind every copy a replica keeps current by a KV watch (the active sets, the manifests): open the
//! watch, apply what it delivers, and when it fails or ends, drop the copy and open it again after [`WATCH_RETRY`].

use std::future::Future;
use std::time::Duration;

use async_nats::jetstream::kv;
use futures::StreamExt as _;

/// The pause before a failed or ended watch is started again.
pub(crate) const WATCH_RETRY: Duration = Duration::from_secs(1);

/// Keeps a copy current until the task is aborted: `open` makes the watch, `reset(true)` starts the copy anew once
/// it runs, `apply` takes each entry, `reset(false)` drops the copy when the watch fails or ends. `what` names the
/// copy in the log.
pub(crate) async fn keep_current<W>(
    what: &'static str,
    open: impl Fn() -> W,
    reset: impl Fn(bool),
    apply: impl Fn(&kv::Entry),
) where
    W: Future<Output = Result<kv::Watch, kv::WatchError>>,
{
    loop {
        match open().await {
            Ok(mut watch) => {
                reset(true);
                while let Some(entry) = watch.next().await {
                    match entry {
                        Ok(entry) => apply(&entry),
                        Err(e) => {
                            tracing::warn!(copy = what, error = %e, "a watched copy's watch failed; restarting it");
                            break;
                        }
                    }
                }
            }
            Err(e) => tracing::warn!(copy = what, error = %e, "cannot watch for a copy"),
        }
        reset(false);
        tokio::time::sleep(WATCH_RETRY).await;
    }
}
