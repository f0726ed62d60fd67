//! Key-value stores: small records that outlive the request that wrote them and that any
//! process of the graph may read back, such as the Responses API's stored responses (a
//! conversation continued through another frontend reads its earlier turns here).
//!
//! A [`Bucket`] is bounded twice, in entries and in age: a store holds what clients asked to
//! keep, and it must not grow without end. [`EmbeddedStore`] keeps buckets in memory for
//! one-process graphs; the NATS implementation (`dyn-runtime`'s `planes::nats`) keeps each in a
//! JetStream stream on the server, one subject per key, as NATS's own key-value buckets do
//! (whose creation the nats-server 2.9 of Debian refuses).

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use parking_lot::Mutex;

use super::PlaneError;

/// A bucket's name and bounds: past `max_entries` the oldest entry goes, and an entry older
/// than `max_age` is gone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bucket {
    pub name: String,
    pub max_entries: u64,
    pub max_age: Duration,
}

#[async_trait]
pub trait KeyValue: Send + Sync + 'static {
    /// Store `value` under `key`, replacing what was there.
    async fn put(&self, bucket: &Bucket, key: &str, value: Bytes) -> Result<(), PlaneError>;

    /// The value under `key`, unless it was never put, was deleted, or aged or was pushed out.
    async fn get(&self, bucket: &Bucket, key: &str) -> Result<Option<Bytes>, PlaneError>;

    /// Remove `key`; true when there was a value to remove.
    async fn delete(&self, bucket: &Bucket, key: &str) -> Result<bool, PlaneError>;
}

/// Bucket names and keys are subject tokens: letters, digits, `-` and `_` (at most 256).
pub fn check(bucket: &Bucket, key: &str) -> Result<(), PlaneError> {
    for name in [bucket.name.as_str(), key] {
        if name.len() > 256 || !super::queue::valid_name(name) {
            return Err(PlaneError::InvalidSubject(format!(
                "store name `{name}` (letters, digits, - and _ only, at most 256)"
            )));
        }
    }
    Ok(())
}

/// [`KeyValue`] in this process's memory.
#[derive(Default)]
pub struct EmbeddedStore {
    buckets: Mutex<HashMap<String, Entries>>,
}

/// One bucket: the values, and their keys oldest first (a key put again moves to the end).
#[derive(Default)]
struct Entries {
    values: HashMap<String, (Instant, Bytes)>,
    order: VecDeque<(Instant, String)>,
}

impl Entries {
    /// Drop entries past the bucket's bounds, oldest first. `order` may hold stale pairs (a
    /// key put again or deleted since): a pair counts only while its time is its key's.
    fn trim(&mut self, b: &Bucket, now: Instant) {
        while let Some((at, key)) = self.order.front() {
            let current = self.values.get(key).is_some_and(|(t, _)| t == at);
            let over = self.values.len() as u64 > b.max_entries
                || now.saturating_duration_since(*at) > b.max_age;
            if current && !over {
                break;
            }
            if current {
                self.values.remove(key);
            }
            self.order.pop_front();
        }
    }
}

#[async_trait]
impl KeyValue for EmbeddedStore {
    async fn put(&self, bucket: &Bucket, key: &str, value: Bytes) -> Result<(), PlaneError> {
        check(bucket, key)?;
        let now = Instant::now();
        let mut buckets = self.buckets.lock();
        let e = buckets.entry(bucket.name.clone()).or_default();
        e.values.insert(key.to_owned(), (now, value));
        e.order.push_back((now, key.to_owned()));
        e.trim(bucket, now);
        // Stale pairs (keys put again) must not pile up either.
        if e.order.len() > 2 * e.values.len() + 16 {
            let values = &e.values;
            e.order
                .retain(|(at, k)| values.get(k).is_some_and(|(t, _)| t == at));
        }
        Ok(())
    }

    async fn get(&self, bucket: &Bucket, key: &str) -> Result<Option<Bytes>, PlaneError> {
        check(bucket, key)?;
        let mut buckets = self.buckets.lock();
        let Some(e) = buckets.get_mut(&bucket.name) else {
            return Ok(None);
        };
        e.trim(bucket, Instant::now());
        Ok(e.values.get(key).map(|(_, v)| v.clone()))
    }

    async fn delete(&self, bucket: &Bucket, key: &str) -> Result<bool, PlaneError> {
        check(bucket, key)?;
        let mut buckets = self.buckets.lock();
        Ok(buckets
            .get_mut(&bucket.name)
            .is_some_and(|e| e.values.remove(key).is_some()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bucket(max_entries: u64, max_age: Duration) -> Bucket {
        Bucket {
            name: "responses".into(),
            max_entries,
            max_age,
        }
    }

    #[tokio::test]
    async fn values_come_back_until_deleted_and_the_oldest_go_past_the_bound() {
        let s = EmbeddedStore::default();
        let b = bucket(2, Duration::from_secs(60));
        s.put(&b, "a", Bytes::from_static(b"1")).await.unwrap();
        s.put(&b, "b", Bytes::from_static(b"2")).await.unwrap();
        // Put again: `a` is now the newest, so `b` goes first.
        s.put(&b, "a", Bytes::from_static(b"3")).await.unwrap();
        s.put(&b, "c", Bytes::from_static(b"4")).await.unwrap();
        assert_eq!(s.get(&b, "a").await.unwrap().as_deref(), Some(&b"3"[..]));
        assert_eq!(s.get(&b, "b").await.unwrap(), None);
        assert!(s.delete(&b, "c").await.unwrap());
        assert!(!s.delete(&b, "c").await.unwrap());
        assert_eq!(s.get(&b, "c").await.unwrap(), None);
        // Another bucket of the same store is its own.
        let other = Bucket {
            name: "other".into(),
            ..b.clone()
        };
        assert_eq!(s.get(&other, "a").await.unwrap(), None);
        assert!(s.put(&b, "no.dots", Bytes::new()).await.is_err());
    }

    #[tokio::test]
    async fn entries_age_out() {
        let s = EmbeddedStore::default();
        let b = bucket(10, Duration::from_millis(20));
        s.put(&b, "a", Bytes::from_static(b"1")).await.unwrap();
        tokio::time::sleep(Duration::from_millis(40)).await;
        assert_eq!(s.get(&b, "a").await.unwrap(), None);
    }

    #[tokio::test]
    async fn keys_put_again_and_again_leave_no_stale_order_behind() {
        let s = EmbeddedStore::default();
        let b = bucket(4, Duration::from_secs(60));
        for i in 0..1000u32 {
            s.put(&b, "k", Bytes::from(i.to_string())).await.unwrap();
        }
        let buckets = s.buckets.lock();
        let e = &buckets["responses"];
        assert_eq!(e.values.len(), 1);
        assert!(e.order.len() <= 18, "{}", e.order.len());
    }
}
