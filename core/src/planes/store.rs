//! Key-value stores: small records that outlive the request that wrote them and that any
//! process of the graph may read back, such as the Responses API's stored responses (a
//! conversation continued through another frontend reads its earlier turns here).
//!
//! A [`Bucket`] is bounded in entries, in bytes and in age: a store holds what clients asked
//! to keep, and it must not grow without end — counting entries alone let a few large records
//! take the process's memory. Entries may be put for an owner (a tenant): an owner past its
//! own bounds loses its own oldest entries, and a bucket past its bounds loses the oldest of
//! whoever holds the most, so one owner filling the store cannot push every other owner's
//! entries out. [`EmbeddedStore`] keeps buckets in memory for one-process graphs and enforces
//! all of it; the NATS implementation (`dyn-runtime`'s `planes::nats`) keeps each in a
//! JetStream stream on the server, one subject per key, as NATS's own key-value buckets do
//! (whose creation the nats-server 2.9 of Debian refuses), and enforces the bucket's bounds
//! but not the owners' (a stream has no per-owner limits).

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use parking_lot::Mutex;

use super::PlaneError;

/// A bucket's name and bounds: past `max_entries` or `max_bytes` (keys and values) an entry
/// goes, the oldest of the owner holding the most; an owner past `max_owner_entries` or
/// `max_owner_bytes` loses its own oldest; an entry older than `max_age` is gone. The entry
/// just put is never the one pushed out: a value larger than `max_bytes` is refused instead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bucket {
    pub name: String,
    pub max_entries: u64,
    pub max_bytes: u64,
    pub max_owner_entries: u64,
    pub max_owner_bytes: u64,
    pub max_age: Duration,
}

impl Bucket {
    /// A bucket bounded in entries and age only (no byte or per-owner bound beyond them).
    pub fn new(name: impl Into<String>, max_entries: u64, max_age: Duration) -> Self {
        Self {
            name: name.into(),
            max_entries,
            max_bytes: u64::MAX,
            max_owner_entries: u64::MAX,
            max_owner_bytes: u64::MAX,
            max_age,
        }
    }
}

#[async_trait]
pub trait KeyValue: Send + Sync + 'static {
    /// Store `value` under `key`, replacing what was there.
    async fn put(&self, bucket: &Bucket, key: &str, value: Bytes) -> Result<(), PlaneError>;

    /// Store `value` under `key` for `owner`, whose entries the bucket's per-owner bounds
    /// count. A store without per-owner bounds stores it as [`KeyValue::put`] does.
    async fn put_for(
        &self,
        bucket: &Bucket,
        owner: &str,
        key: &str,
        value: Bytes,
    ) -> Result<(), PlaneError> {
        let _ = owner;
        self.put(bucket, key, value).await
    }

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

/// What an entry counts against its bucket's byte bounds: its key and its value.
fn size(key: &str, value: &Bytes) -> u64 {
    (key.len() + value.len()) as u64
}

/// A value larger than the bucket could ever hold is refused, not stored past the bound.
pub fn check_size(bucket: &Bucket, key: &str, value: &Bytes) -> Result<(), PlaneError> {
    let n = size(key, value);
    if n > bucket.max_bytes {
        return Err(PlaneError::Backend {
            plane: "store",
            message: format!(
                "a value of {n} bytes is larger than bucket {}'s bound of {} bytes",
                bucket.name, bucket.max_bytes
            ),
        });
    }
    Ok(())
}

/// [`KeyValue`] in this process's memory.
#[derive(Default)]
pub struct EmbeddedStore {
    buckets: Mutex<HashMap<String, Entries>>,
}

/// One entry: when it was put (its place in the order, and its age), whose it is, its value.
struct Entry {
    seq: u64,
    at: Instant,
    owner: String,
    value: Bytes,
}

/// What one owner holds in a bucket: its bytes, and its keys oldest first (by `seq`).
#[derive(Default)]
struct Owner {
    bytes: u64,
    order: BTreeMap<u64, String>,
}

/// One bucket: the values, their keys oldest first (a key put again moves to the end), each
/// owner's share, and the bytes held. Every key is in `values`, `order` and its owner's
/// `order` exactly once, so nothing stale piles up.
#[derive(Default)]
struct Entries {
    values: HashMap<String, Entry>,
    order: BTreeMap<u64, String>,
    owners: HashMap<String, Owner>,
    bytes: u64,
    next: u64,
}

impl Entries {
    fn remove(&mut self, key: &str) -> Option<Entry> {
        let e = self.values.remove(key)?;
        let n = size(key, &e.value);
        self.order.remove(&e.seq);
        self.bytes = self.bytes.saturating_sub(n);
        if let Some(o) = self.owners.get_mut(&e.owner) {
            o.order.remove(&e.seq);
            o.bytes = o.bytes.saturating_sub(n);
            if o.order.is_empty() {
                self.owners.remove(&e.owner);
            }
        }
        Some(e)
    }

    fn insert(&mut self, owner: &str, key: &str, value: Bytes, now: Instant) -> u64 {
        self.remove(key);
        let seq = self.next;
        self.next += 1;
        let n = size(key, &value);
        self.bytes += n;
        let o = self.owners.entry(owner.to_owned()).or_default();
        o.bytes += n;
        o.order.insert(seq, key.to_owned());
        self.order.insert(seq, key.to_owned());
        self.values.insert(
            key.to_owned(),
            Entry {
                seq,
                at: now,
                owner: owner.to_owned(),
                value,
            },
        );
        seq
    }

    /// The oldest key of `owner`, unless that is the entry `keep`.
    fn oldest_of(&self, owner: &str, keep: Option<u64>) -> Option<String> {
        let (seq, key) = self.owners.get(owner)?.order.iter().next()?;
        (Some(*seq) != keep).then(|| key.clone())
    }

    /// Drop entries past the bucket's bounds: aged ones, then `owner`'s oldest while it is
    /// past its own bounds, then the oldest of the largest owner while the bucket is past
    /// its. `keep` (the entry just put) stays whatever else goes.
    fn trim(&mut self, b: &Bucket, now: Instant, owner: Option<&str>, keep: Option<u64>) {
        while let Some((&seq, key)) = self.order.iter().next() {
            let aged = self
                .values
                .get(key)
                .is_some_and(|e| now.saturating_duration_since(e.at) > b.max_age);
            if !aged || Some(seq) == keep {
                break;
            }
            let key = key.clone();
            self.remove(&key);
        }
        if let Some(owner) = owner {
            while let Some(o) = self.owners.get(owner)
                && (o.order.len() as u64 > b.max_owner_entries || o.bytes > b.max_owner_bytes)
            {
                let Some(key) = self.oldest_of(owner, keep) else {
                    break;
                };
                self.remove(&key);
            }
        }
        loop {
            let by_entries = self.values.len() as u64 > b.max_entries;
            if !by_entries && self.bytes <= b.max_bytes {
                break;
            }
            // Whoever holds the most pays: by entries when there are too many, else by bytes.
            let largest = self
                .owners
                .iter()
                // An owner whose oldest is the entry just put holds nothing else.
                .filter(|(_, o)| o.order.keys().next().copied() != keep)
                .max_by_key(|(_, o)| match by_entries {
                    true => o.order.len() as u64,
                    false => o.bytes,
                })
                .map(|(name, _)| name.clone());
            let Some(key) = largest.and_then(|name| self.oldest_of(&name, keep)) else {
                break;
            };
            self.remove(&key);
        }
    }
}

impl EmbeddedStore {
    fn put_owned(
        &self,
        bucket: &Bucket,
        owner: &str,
        key: &str,
        value: Bytes,
    ) -> Result<(), PlaneError> {
        check(bucket, key)?;
        check_size(bucket, key, &value)?;
        let mut buckets = self.buckets.lock();
        // Taken under the lock, so entries' times follow their order.
        let now = Instant::now();
        let e = buckets.entry(bucket.name.clone()).or_default();
        let seq = e.insert(owner, key, value, now);
        e.trim(bucket, now, Some(owner), Some(seq));
        Ok(())
    }
}

#[async_trait]
impl KeyValue for EmbeddedStore {
    async fn put(&self, bucket: &Bucket, key: &str, value: Bytes) -> Result<(), PlaneError> {
        self.put_owned(bucket, "", key, value)
    }

    async fn put_for(
        &self,
        bucket: &Bucket,
        owner: &str,
        key: &str,
        value: Bytes,
    ) -> Result<(), PlaneError> {
        self.put_owned(bucket, owner, key, value)
    }

    async fn get(&self, bucket: &Bucket, key: &str) -> Result<Option<Bytes>, PlaneError> {
        check(bucket, key)?;
        let mut buckets = self.buckets.lock();
        let Some(e) = buckets.get_mut(&bucket.name) else {
            return Ok(None);
        };
        e.trim(bucket, Instant::now(), None, None);
        Ok(e.values.get(key).map(|e| e.value.clone()))
    }

    async fn delete(&self, bucket: &Bucket, key: &str) -> Result<bool, PlaneError> {
        check(bucket, key)?;
        let mut buckets = self.buckets.lock();
        Ok(buckets
            .get_mut(&bucket.name)
            .is_some_and(|e| e.remove(key).is_some()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bucket(max_entries: u64, max_age: Duration) -> Bucket {
        Bucket::new("responses", max_entries, max_age)
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
    async fn keys_put_again_and_again_leave_nothing_stale_behind() {
        let s = EmbeddedStore::default();
        let b = bucket(4, Duration::from_secs(60));
        for i in 0..1000u32 {
            s.put(&b, "k", Bytes::from(i.to_string())).await.unwrap();
        }
        let buckets = s.buckets.lock();
        let e = &buckets["responses"];
        assert_eq!((e.values.len(), e.order.len(), e.owners.len()), (1, 1, 1));
        assert_eq!(e.bytes, size("k", &Bytes::from("999")));
    }

    fn kib(n: usize) -> Bytes {
        Bytes::from(vec![b'x'; n << 10])
    }

    #[tokio::test]
    async fn the_bytes_held_stay_within_the_bound_and_a_value_past_it_is_refused() {
        let s = EmbeddedStore::default();
        let b = Bucket {
            max_bytes: 10 << 10,
            ..bucket(1000, Duration::from_secs(60))
        };
        for i in 0..20 {
            s.put(&b, &format!("k{i}"), kib(3)).await.unwrap();
            let held = s.buckets.lock()["responses"].bytes;
            assert!(held <= b.max_bytes, "{held}");
        }
        // The newest three fit; the older ones went, oldest first.
        for i in 0..17 {
            assert_eq!(s.get(&b, &format!("k{i}")).await.unwrap(), None, "k{i}");
        }
        for i in 17..20 {
            assert!(s.get(&b, &format!("k{i}")).await.unwrap().is_some(), "k{i}");
        }
        assert!(s.put(&b, "huge", kib(11)).await.is_err());
        assert!(s.get(&b, "k19").await.unwrap().is_some());
    }

    #[tokio::test]
    async fn an_owner_over_its_share_loses_its_own_oldest_not_others() {
        let s = EmbeddedStore::default();
        let b = Bucket {
            max_bytes: 20 << 10,
            max_owner_bytes: 10 << 10,
            max_owner_entries: 3,
            ..bucket(8, Duration::from_secs(60))
        };
        s.put_for(&b, "b", "b1", kib(1)).await.unwrap();
        s.put_for(&b, "b", "b2", kib(1)).await.unwrap();
        for i in 0..50 {
            s.put_for(&b, "a", &format!("a{i}"), kib(3)).await.unwrap();
        }
        // `a` keeps its newest that fit its share; `b`'s are untouched.
        assert!(s.get(&b, "b1").await.unwrap().is_some());
        assert!(s.get(&b, "b2").await.unwrap().is_some());
        assert!(s.get(&b, "a49").await.unwrap().is_some());
        assert!(s.get(&b, "a48").await.unwrap().is_some());
        assert!(s.get(&b, "a46").await.unwrap().is_none());
        // Many small ones: past its entry share, too.
        for i in 0..10 {
            s.put_for(&b, "a", &format!("s{i}"), Bytes::from_static(b"1"))
                .await
                .unwrap();
        }
        assert!(s.get(&b, "s7").await.unwrap().is_some());
        assert!(s.get(&b, "s6").await.unwrap().is_none());
        assert!(s.get(&b, "b1").await.unwrap().is_some());
    }

    #[tokio::test]
    async fn a_full_bucket_takes_from_the_owner_holding_the_most() {
        let s = EmbeddedStore::default();
        // No per-owner bound: the bucket's bound alone.
        let b = Bucket {
            max_bytes: 10 << 10,
            ..bucket(1000, Duration::from_secs(60))
        };
        s.put_for(&b, "b", "b1", kib(2)).await.unwrap();
        for i in 0..20 {
            s.put_for(&b, "a", &format!("a{i}"), kib(2)).await.unwrap();
        }
        assert!(
            s.get(&b, "b1").await.unwrap().is_some(),
            "the smaller owner kept its own"
        );
        assert!(s.get(&b, "a19").await.unwrap().is_some());
        // Now `b` is the one putting, and `a` still holds the most: `a` gives way.
        s.put_for(&b, "b", "b2", kib(2)).await.unwrap();
        assert!(s.get(&b, "b1").await.unwrap().is_some());
        assert!(s.get(&b, "b2").await.unwrap().is_some());
        let held = s.buckets.lock()["responses"].bytes;
        assert!(held <= b.max_bytes, "{held}");
        // By entries too: the owner with the most entries gives way.
        let c = Bucket::new("other", 3, Duration::from_secs(60));
        s.put_for(&c, "b", "x1", Bytes::new()).await.unwrap();
        for i in 0..10 {
            s.put_for(&c, "a", &format!("y{i}"), Bytes::new())
                .await
                .unwrap();
        }
        assert!(s.get(&c, "x1").await.unwrap().is_some());
    }
}
