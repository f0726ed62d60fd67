//! Work queues: jobs that exactly one worker takes, such as remote prefill requests.
//!
//! A queue has partitions (one per worker, so a sender that chose its worker KV-aware still
//! gets a queue's buffering and depth); a job pushed to a partition waits there until the
//! worker taking that partition takes it, and is gone once taken. [`WorkQueue::depth`] counts
//! the jobs of every partition not yet taken: the backlog a sender weighs before adding to it.
//!
//! [`EmbeddedWorkQueue`] keeps jobs in memory for one-process graphs; the NATS JetStream
//! implementation (`dyn-runtime`'s `planes::nats`) keeps them in a work-queue stream on the server, so
//! they survive the sender and wait for a worker that starts late.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;
use futures::stream::BoxStream;
use parking_lot::Mutex;
use tokio::sync::Notify;

use super::PlaneError;

#[async_trait]
pub trait WorkQueue: Send + Sync + 'static {
    /// Append `job` to partition `partition` of `queue`.
    async fn push(&self, queue: &str, partition: &str, job: Bytes) -> Result<(), PlaneError>;

    /// Jobs in all partitions of `queue` that no worker has taken yet.
    async fn depth(&self, queue: &str) -> Result<u64, PlaneError>;

    /// Take the jobs of one partition as they come. One taker per partition; a job is removed
    /// from the queue when this stream yields it.
    async fn take(
        &self,
        queue: &str,
        partition: &str,
    ) -> Result<BoxStream<'static, Bytes>, PlaneError>;
}

/// Names are subject tokens: letters, digits, `-` and `_`.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

pub fn check(queue: &str, partition: Option<&str>) -> Result<(), PlaneError> {
    for name in std::iter::once(queue).chain(partition) {
        if !valid_name(name) {
            return Err(PlaneError::InvalidSubject(format!(
                "queue name `{name}` (letters, digits, - and _ only)"
            )));
        }
    }
    Ok(())
}

#[derive(Default)]
struct Partition {
    jobs: Mutex<VecDeque<Bytes>>,
    ready: Notify,
}

/// In-process work queue.
#[derive(Default)]
pub struct EmbeddedWorkQueue {
    queues: Mutex<HashMap<String, HashMap<String, Arc<Partition>>>>,
}

impl EmbeddedWorkQueue {
    fn partition(&self, queue: &str, partition: &str) -> Arc<Partition> {
        self.queues
            .lock()
            .entry(queue.to_owned())
            .or_default()
            .entry(partition.to_owned())
            .or_default()
            .clone()
    }
}

#[async_trait]
impl WorkQueue for EmbeddedWorkQueue {
    async fn push(&self, queue: &str, partition: &str, job: Bytes) -> Result<(), PlaneError> {
        check(queue, Some(partition))?;
        let p = self.partition(queue, partition);
        p.jobs.lock().push_back(job);
        p.ready.notify_one();
        Ok(())
    }

    async fn depth(&self, queue: &str) -> Result<u64, PlaneError> {
        check(queue, None)?;
        Ok(self.queues.lock().get(queue).map_or(0, |ps| {
            ps.values().map(|p| p.jobs.lock().len() as u64).sum()
        }))
    }

    async fn take(
        &self,
        queue: &str,
        partition: &str,
    ) -> Result<BoxStream<'static, Bytes>, PlaneError> {
        check(queue, Some(partition))?;
        let p = self.partition(queue, partition);
        Ok(futures::stream::unfold(p, |p| async move {
            loop {
                // `Notify` keeps a permit for a push between this pop and the wait.
                let job = p.jobs.lock().pop_front();
                match job {
                    Some(job) => return Some((job, p)),
                    None => p.ready.notified().await,
                }
            }
        })
        .boxed())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;

    #[tokio::test]
    async fn jobs_wait_in_their_partition_until_taken_once() {
        let q = EmbeddedWorkQueue::default();
        q.push("prefill", "a", Bytes::from_static(b"1"))
            .await
            .unwrap();
        q.push("prefill", "b", Bytes::from_static(b"2"))
            .await
            .unwrap();
        q.push("prefill", "a", Bytes::from_static(b"3"))
            .await
            .unwrap();
        assert_eq!(q.depth("prefill").await.unwrap(), 3);
        assert_eq!(q.depth("other").await.unwrap(), 0);
        let mut a = q.take("prefill", "a").await.unwrap();
        assert_eq!(a.next().await.unwrap(), Bytes::from_static(b"1"));
        assert_eq!(a.next().await.unwrap(), Bytes::from_static(b"3"));
        assert_eq!(q.depth("prefill").await.unwrap(), 1, "b's job is left");
        // A taker waits for jobs pushed later.
        let later = tokio::spawn(async move { a.next().await });
        q.push("prefill", "a", Bytes::from_static(b"4"))
            .await
            .unwrap();
        assert_eq!(later.await.unwrap().unwrap(), Bytes::from_static(b"4"));
        assert!(q.push("pre.fill", "a", Bytes::new()).await.is_err());
        assert!(q.take("prefill", "").await.is_err());
    }
}
