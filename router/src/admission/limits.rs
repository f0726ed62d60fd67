//! Per-tenant rate limits: buckets of requests and of tokens (prompt + `max_tokens`) per
//! minute, each holding a minute's worth and refilled continuously. A request over a limit is
//! refused at once (429, with the seconds until there is room); one refused for want of room
//! (503) gets back what it took.

use std::time::Duration;

// tokio's clock, which tests can pause and advance.
use tokio::time::Instant;

use super::queue::SERVED_KEPT;
use super::{Admission, State};

/// A tenant's rate-limit buckets: requests and tokens left, refilled continuously up to a
/// minute's worth.
pub(super) struct Bucket {
    requests: f64,
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn refill(&mut self, (rpm, tpm): (Option<f64>, Option<f64>), now: Instant) {
        let minutes = (now - self.at).as_secs_f64() / 60.0;
        self.at = now;
        if let Some(r) = rpm {
            self.requests = (self.requests + r * minutes).min(r);
        }
        if let Some(t) = tpm {
            self.tokens = (self.tokens + t * minutes).min(t);
        }
    }
}

impl Admission {
    /// Takes a request from `tenant`'s buckets, or says in how many seconds there will be
    /// room (a request over a whole minute's tokens never fits: an hour).
    pub(super) fn take(&self, s: &mut State, tenant: &str, tokens: u64) -> Result<(), u64> {
        let tc = self.tenant(tenant);
        if tc.requests_per_minute.is_none() && tc.tokens_per_minute.is_none() {
            return Ok(());
        }
        let now = Instant::now();
        if s.buckets.len() > SERVED_KEPT {
            // A bucket untouched for a minute is full again: the same as none.
            s.buckets
                .retain(|_, b| now - b.at < Duration::from_secs(60));
        }
        let limits = (
            tc.requests_per_minute.map(f64::from),
            tc.tokens_per_minute.map(|t| t as f64),
        );
        let b = s.buckets.entry(tenant.to_owned()).or_insert(Bucket {
            requests: limits.0.unwrap_or(0.0),
            tokens: limits.1.unwrap_or(0.0),
            at: now,
        });
        b.refill(limits, now);
        let need = [
            (limits.0, b.requests, 1.0),
            (limits.1, b.tokens, tokens as f64),
        ];
        let wait = need
            .iter()
            .filter_map(|&(limit, have, want)| {
                let limit = limit?;
                if want > limit {
                    return Some(3600.0);
                }
                (have < want).then(|| (want - have) / (limit / 60.0))
            })
            .fold(0.0f64, f64::max);
        if wait > 0.0 {
            return Err(wait.ceil() as u64);
        }
        b.requests -= 1.0;
        b.tokens -= tokens as f64;
        Ok(())
    }

    /// Gives back what a refused request took from its tenant's rate limits: a 503 does not
    /// count against them.
    pub(super) fn refund(&self, s: &mut State, tenant: &str, tokens: u64) {
        let tc = self.tenant(tenant);
        if let Some(b) = s.buckets.get_mut(tenant) {
            if let Some(r) = tc.requests_per_minute {
                b.requests = (b.requests + 1.0).min(f64::from(r));
            }
            if let Some(t) = tc.tokens_per_minute {
                b.tokens = (b.tokens + tokens as f64).min(t as f64);
            }
        }
    }
}
