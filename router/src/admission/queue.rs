//! The waiting requests' order alone, with no lock and no clock of its own beyond tokio's
//! `Instant`: priority first, then the tenant's virtual token counter (tokens served over
//! its weight, node-wide, plus the lift it got on arriving behind tenants served more), then
//! deadline and arrival; which entry a full queue refuses; and the charges to share with the
//! node's other routers.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

// tokio's clock, which tests can pause and advance.
use tokio::time::Instant;

/// Where a waiting request ranks: lower first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Rank {
    pub priority: i32,
    pub deadline: Instant,
    seq: u64,
}

/// The waiting requests, bounded: the best-ranked request (priority, then deadline, then
/// arrival) of the least-served tenant (its virtual token counter) goes first.
#[derive(Debug)]
pub struct Queue<T> {
    /// Each tenant's waiting requests, best first, with their cost (tokens over weight).
    waiting: HashMap<String, BTreeMap<Rank, (f64, T)>>,
    /// Each tenant's tokens served over its weight, by every router of the node: sums,
    /// so the routers agree whatever order the charges reach them in.
    served: HashMap<String, f64>,
    /// What this router adds to a tenant's count when it starts waiting behind tenants
    /// served more (VTC's lift): its counter is `served + lift`.
    lift: HashMap<String, f64>,
    /// The counter of the tenant this router served last: the floor of a tenant that starts
    /// waiting in an empty queue.
    last: f64,
    /// Tenants' charges made here since [`Queue::take_charged`], for the other routers.
    charged: Vec<(String, f64)>,
    /// Each tenant's recent service (tokens over weight, halving every [`RECENT_HALF_LIFE`])
    /// and when it was last brought up to date: who was served least lately, lifts aside.
    recent: HashMap<String, (f64, Instant)>,
    len: usize,
    cap: usize,
    seq: u64,
}

/// What pushing into a full queue did.
#[derive(Debug, PartialEq, Eq)]
pub enum Pushed<T> {
    /// Queued.
    Waiting,
    /// Queued in place of this worse entry, which is refused.
    Displaced(T),
    /// Not queued: it ranks last in a full queue.
    Refused(T),
}

/// Counters of idle tenants kept at most; beyond, the least served idle ones go (coming back,
/// they would be lifted to the waiting tenants' level anyway).
pub(super) const SERVED_KEPT: usize = 4096;

impl<T> Queue<T> {
    pub fn new(cap: usize) -> Self {
        Self {
            waiting: HashMap::new(),
            served: HashMap::new(),
            lift: HashMap::new(),
            last: 0.0,
            charged: Vec::new(),
            recent: HashMap::new(),
            len: 0,
            cap,
            seq: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A tenant's counter: what it was served over its weight, plus its lift.
    pub fn counter(&self, tenant: &str) -> f64 {
        self.served.get(tenant).copied().unwrap_or(0.0)
            + self.lift.get(tenant).copied().unwrap_or(0.0)
    }

    /// Where `tenant`'s entry `rank` stands in the order the queue would empty in: its
    /// tenant's counter once the `ahead` costs of its requests before it are charged.
    fn projected(&self, tenant: &str, rank: &Rank, ahead: f64) -> (i32, f64, Instant, u64) {
        (
            rank.priority,
            self.counter(tenant) + ahead,
            rank.deadline,
            rank.seq,
        )
    }

    /// Counts `cost` (tokens over weight) as served to `tenant` here: a request that went
    /// without waiting is charged as one that waited. Kept for the other routers.
    pub fn charge(&mut self, tenant: &str, cost: f64) {
        if self.charged.len() < SERVED_KEPT {
            self.charged.push((tenant.to_owned(), cost));
        }
        self.credit(tenant, cost);
        self.last = self.counter(tenant);
    }

    /// The charges made here since last asked.
    pub fn take_charged(&mut self) -> Vec<(String, f64)> {
        std::mem::take(&mut self.charged)
    }

    /// Counts `cost` as served to `tenant` (here, or by another router of the node).
    pub fn credit(&mut self, tenant: &str, cost: f64) {
        *self.served.entry(tenant.to_owned()).or_default() += cost;
        let now = Instant::now();
        let r = self.recent.entry(tenant.to_owned()).or_insert((0.0, now));
        *r = (decayed(*r, now) + cost, now);
        if self.served.len() > SERVED_KEPT {
            self.forget_idle();
        }
    }

    /// Drops the least served idle tenants down to half the bound.
    fn forget_idle(&mut self) {
        let mut idle: Vec<(f64, String)> = self
            .served
            .iter()
            .filter(|(t, _)| !self.waiting.contains_key(*t))
            .map(|(t, _)| (self.counter(t), t.clone()))
            .collect();
        let drop = self
            .served
            .len()
            .saturating_sub(SERVED_KEPT / 2)
            .min(idle.len());
        if drop == 0 {
            return;
        }
        idle.select_nth_unstable_by(drop - 1, |a, b| a.0.total_cmp(&b.0));
        for (_, t) in idle.into_iter().take(drop) {
            self.served.remove(&t);
            self.lift.remove(&t);
            self.recent.remove(&t);
        }
    }

    /// `tenant`'s recent service at `now`.
    pub fn recent(&self, tenant: &str, now: Instant) -> f64 {
        self.recent.get(tenant).map_or(0.0, |r| decayed(*r, now))
    }

    /// `tenant` starts waiting with a request of `cost`: a counter below the waiting tenants'
    /// lowest (in an empty queue, below the tenant served last) is lifted to just under it —
    /// the request goes next, and once charged the tenant stands level with them — so time
    /// away from the queue banks no credit (VTC).
    pub fn lift_on_arrival(&mut self, tenant: &str, cost: f64) {
        if self.waiting.contains_key(tenant) {
            return;
        }
        let floor = self
            .waiting
            .keys()
            .map(|t| self.counter(t))
            .min_by(f64::total_cmp)
            .unwrap_or(self.last);
        let c = self.counter(tenant);
        let to = floor - cost;
        if c < to {
            *self.lift.entry(tenant.to_owned()).or_default() += to - c;
        }
    }

    pub fn push(
        &mut self,
        priority: i32,
        deadline: Instant,
        tenant: &str,
        cost: f64,
        item: T,
    ) -> Pushed<T> {
        self.seq += 1;
        let rank = Rank {
            priority,
            deadline,
            seq: self.seq,
        };
        self.lift_on_arrival(tenant, cost);
        if self.len >= self.cap {
            // The worst entry is the one that would go last: each tenant's last, at its
            // counter once the tenant's requests before it are served.
            let worst = self
                .waiting
                .iter()
                .filter_map(|(t, q)| {
                    let (r, (cost, _)) = q.last_key_value()?;
                    let ahead: f64 = q.values().map(|(c, _)| c).sum::<f64>() - cost;
                    Some((self.projected(t, r, ahead), t, *r))
                })
                .max_by(|a, b| cmp_key(&a.0, &b.0));
            let Some((worst_key, worst_tenant, worst_rank)) = worst else {
                return Pushed::Refused(item);
            };
            let ahead: f64 = self
                .waiting
                .get(tenant)
                .map_or(0.0, |q| q.values().map(|(c, _)| c).sum());
            if cmp_key(&worst_key, &self.projected(tenant, &rank, ahead)).is_le() {
                return Pushed::Refused(item);
            }
            let worst_tenant = worst_tenant.clone();
            let out = self.remove(&worst_tenant, &worst_rank);
            self.insert(tenant, rank, cost, item);
            return match out {
                Some(out) => Pushed::Displaced(out),
                None => Pushed::Waiting,
            };
        }
        self.insert(tenant, rank, cost, item);
        Pushed::Waiting
    }

    fn insert(&mut self, tenant: &str, rank: Rank, cost: f64, item: T) {
        self.waiting
            .entry(tenant.to_owned())
            .or_default()
            .insert(rank, (cost, item));
        self.len += 1;
    }

    fn remove(&mut self, tenant: &str, rank: &Rank) -> Option<T> {
        let q = self.waiting.get_mut(tenant)?;
        let (_, item) = q.remove(rank)?;
        if q.is_empty() {
            self.waiting.remove(tenant);
        }
        self.len -= 1;
        Some(item)
    }

    /// The next request to go, taken out and charged to its tenant.
    #[cfg(test)]
    pub fn pop(&mut self) -> Option<(Rank, T)> {
        let (tenant, rank) = self.peek_where(|_, _| true)?;
        self.take(&tenant, &rank).map(|(_, r, t)| (r, t))
    }

    /// The next request to go among each tenant's best-ranked one that `may_go` allows.
    pub fn peek_where(&self, may_go: impl Fn(&str, &Rank) -> bool) -> Option<(String, Rank)> {
        self.waiting
            .iter()
            .filter_map(|(t, q)| q.first_key_value().map(|(r, _)| (t, *r)))
            .filter(|(t, r)| may_go(t, r))
            .map(|(t, r)| (self.projected(t, &r, 0.0), t, r))
            .min_by(|a, b| cmp_key(&a.0, &b.0))
            .map(|(_, t, r)| (t.clone(), r))
    }

    /// Takes out `tenant`'s request `rank`, charged to it.
    pub fn take(&mut self, tenant: &str, rank: &Rank) -> Option<(String, Rank, T)> {
        let cost = self
            .waiting
            .get(tenant)
            .and_then(|q| q.get(rank))
            .map_or(0.0, |(c, _)| *c);
        let item = self.remove(tenant, rank)?;
        self.charge(tenant, cost);
        Some((tenant.to_owned(), *rank, item))
    }

    /// Keeps only the entries still waiting (their client has not left).
    pub fn retain(&mut self, mut waiting: impl FnMut(&T) -> bool) {
        for q in self.waiting.values_mut() {
            q.retain(|_, (_, v)| waiting(v));
        }
        self.waiting.retain(|_, q| !q.is_empty());
        self.len = self.waiting.values().map(BTreeMap::len).sum();
    }

    /// Takes out the entries `late(place, rank, entry)` says to, `place` being where each
    /// stands in the order they would go in now (0 goes next).
    pub fn take_late(&mut self, mut late: impl FnMut(usize, &Rank, &T) -> bool) -> Vec<T> {
        let mut all = Vec::with_capacity(self.len);
        for (t, q) in &self.waiting {
            let mut ahead = 0.0;
            for (r, (cost, _)) in q {
                all.push((self.projected(t, r, ahead), t.clone(), *r));
                ahead += cost;
            }
        }
        all.sort_by(|a, b| cmp_key(&a.0, &b.0));
        let waiting = &self.waiting;
        let out: Vec<(String, Rank)> = all
            .into_iter()
            .enumerate()
            .filter(|(i, (_, t, r))| {
                waiting
                    .get(t)
                    .and_then(|q| q.get(r))
                    .is_some_and(|(_, item)| late(*i, r, item))
            })
            .map(|(_, (_, t, r))| (t, r))
            .collect();
        out.iter().filter_map(|(t, r)| self.remove(t, r)).collect()
    }

    /// The tenants with requests waiting.
    pub fn tenants(&self) -> impl Iterator<Item = &str> {
        self.waiting.keys().map(String::as_str)
    }

    /// How many wait, by priority and by tenant.
    pub fn waiting_by(&self) -> (BTreeMap<i32, usize>, HashMap<&str, usize>) {
        let mut by_priority = BTreeMap::new();
        let mut by_tenant = HashMap::new();
        for (t, q) in &self.waiting {
            for r in q.keys() {
                *by_priority.entry(r.priority).or_default() += 1;
                *by_tenant.entry(t.as_str()).or_default() += 1;
            }
        }
        (by_priority, by_tenant)
    }

    /// What this router added to `tenant`'s counter on its arrivals.
    pub fn lift_of(&self, tenant: &str) -> f64 {
        self.lift.get(tenant).copied().unwrap_or(0.0)
    }

    /// Each tenant's tokens served over weight, node-wide.
    pub fn counters(&self) -> Vec<(String, f64)> {
        let mut out: Vec<(String, f64)> =
            self.served.iter().map(|(t, c)| (t.clone(), *c)).collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }
}

/// How fast recent service is forgotten (see [`Queue::recent`]).
const RECENT_HALF_LIFE: Duration = Duration::from_secs(5);

/// A recent-service value `(value, at)` brought to `now`.
fn decayed((value, at): (f64, Instant), now: Instant) -> f64 {
    let halves = now.saturating_duration_since(at).as_secs_f64() / RECENT_HALF_LIFE.as_secs_f64();
    value * 0.5f64.powf(halves)
}

fn cmp_key(a: &(i32, f64, Instant, u64), b: &(i32, f64, Instant, u64)) -> std::cmp::Ordering {
    a.0.cmp(&b.0)
        .then(a.1.total_cmp(&b.1))
        .then(a.2.cmp(&b.2))
        .then(a.3.cmp(&b.3))
}
