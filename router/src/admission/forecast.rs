//! The refusal forecast: the pace at which requests finish (a moving average of the gaps
//! between finishes that leave a place for the queue), and the waiters it says would start
//! past their deadline, refused as soon as they arrive rather than when the deadline comes.

use std::time::Duration;

// tokio's clock, which tests can pause and advance.
use tokio::time::Instant;

use super::room::Room;
use super::{Admission, State, late_error};

/// Weight of the newest gap in the moving average.
const GAP_WEIGHT: f64 = 0.1;
/// A waiting request's predicted start is its place × the gap × this: better-ranked requests
/// arriving meanwhile go ahead of it, so a place is worth more than one gap.
pub(super) const WAIT_MARGIN: f64 = 4.0;

/// How long after it starts waiting a request may still be refused by forecast: one that
/// passed it is kept for its turn — past `max_wait_s` if need be, up to twice that or its own
/// deadline — so that a refusal comes at once or (rarely) at that bound, and a request the
/// forecast let in is served late rather than refused late.
const REFUSE_WINDOW: Duration = Duration::from_millis(50);

impl State {
    /// A request finished, leaving `room` places: a step of the moving average of the gaps
    /// between finishes.
    pub(super) fn count_finish(&mut self, room: Room) {
        // Only a finish that leaves a place for the queue counts: one that brings requests
        // that went past the room back down to it lets no one wait less.
        if self.inflight < room.places {
            let now = Instant::now();
            if let Some(last) = self.last_done {
                let gap = now - last;
                self.gap = Some(match self.gap {
                    Some(avg) => avg.mul_f64(1.0 - GAP_WEIGHT) + gap.mul_f64(GAP_WEIGHT),
                    None => gap,
                });
            }
            self.last_done = Some(now);
        }
    }
}

impl Admission {
    /// Refuses now the waiting requests that would start past their deadline (at the measured
    /// rate of finishes), rather than when their deadline comes.
    pub(super) fn shed(&self, s: &mut State) {
        let Some(gap) = s.gap else { return };
        let now = Instant::now();
        if s.newest.is_none_or(|t| now - t >= REFUSE_WINDOW) {
            return;
        }
        let late = s.queue.take_late(|i, r, w| {
            now - w.since < REFUSE_WINDOW
                && now + gap.mul_f64(WAIT_MARGIN * (i + 1) as f64) > r.deadline
        });
        for w in late {
            self.refund(s, &w.tenant, w.tokens);
            let _ =
                w.tx.send(Err(self.refused(late_error(self.config.max_wait_s))));
        }
    }
}
