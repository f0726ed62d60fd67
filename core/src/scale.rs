//! Scaling: how something outside the graph's nodes (the SLA planner) changes how many
//! replicas of a node run.
//!
//! A [`Connector`] is the one thing a planner needs from where the graph runs. Three fit it:
//! the embedded runtime adds and removes replicas in its own process (`dyn-runtime`'s
//! `ReplicaSet`, `run/replicas.rs`), the
//! multi-process supervisor starts and stops `dyn` processes (the CLI's `procs.rs`), and a
//! Kubernetes connector would patch a Deployment's `spec.replicas` (docs/planes.md). Scaling
//! down is always deregister → drain → stop: routers stop choosing the replica first, the
//! requests it holds finish, then it goes, so no request is lost.

use async_trait::async_trait;

#[derive(Debug, thiserror::Error)]
pub enum ScaleError {
    #[error("node '{0}' cannot be scaled here")]
    UnknownNode(String),
    #[error("scaling node '{node}': {message}")]
    Failed { node: String, message: String },
}

#[async_trait]
pub trait Connector: Send + Sync + 'static {
    /// What it drives, for logs and `dyn inspect planner` (`embedded`, `processes`).
    fn name(&self) -> &'static str;

    /// Replicas of `node` running now, not counting those being drained.
    async fn replicas(&self, node: &str) -> Result<u32, ScaleError>;

    /// Make `node` run `n` replicas. Returns once new replicas serve (registered) and
    /// removed ones are deregistered; their drain may go on after.
    async fn set_replicas(&self, node: &str, n: u32) -> Result<(), ScaleError>;
}
