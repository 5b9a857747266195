//! What a rolling scenario replaces, whatever it is: worker processes (`chaos::Workers`) or front replicas
//! (`fronts::Fronts`); `scenarios` drives the rolling update over it.

/// Replicas a rolling scenario replaces: worker or front processes.
pub(crate) trait Replicas {
    /// Starts one more and waits until it serves.
    async fn add(&mut self) -> anyhow::Result<()>;
    /// SIGTERM to the oldest, waited for; whether it exited on its own (false also when none is left).
    async fn retire_oldest(&mut self) -> bool;
}
