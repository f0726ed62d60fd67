//! The LoRA adapters each worker holds, as far as one router can tell: those it sent there
//! lately, at most the workers' `max_loras` (`lora_slots`) each. The `kv` policy charges a
//! worker that lacks a request's adapter the time it takes to read it (`lora_load_ms`), so an
//! adapter's requests stay where it is held while the load allows.

use std::collections::{HashMap, VecDeque};

use parking_lot::Mutex;

use crate::workers::Workers;

/// The adapters this router has sent to each worker.
pub(crate) struct Adapters {
    /// The LoRA adapters (keys) this router sent to each worker lately, most recent last, at
    /// most `lora_slots`: what it takes the worker to hold.
    held: Mutex<HashMap<u64, VecDeque<String>>>,
    /// `lora_slots`: how many adapters a worker holds at once.
    slots: usize,
}

impl Adapters {
    pub fn new(slots: usize) -> Self {
        Self {
            held: Mutex::new(HashMap::new()),
            slots,
        }
    }

    /// Remember that `worker` got a request of adapter `key` (and so holds it, while it is
    /// among the last `lora_slots` adapters sent there).
    pub fn hold(&self, worker: u64, key: &str, workers: &Workers) {
        let mut held = self.held.lock();
        if held.len() > 2 * workers.instances.read().len() + 8 {
            // Workers gone (scaled down, restarted under new ids) are forgotten.
            let live = workers.live();
            held.retain(|w, _| live.contains(w));
        }
        let h = held.entry(worker).or_default();
        h.retain(|k| k != key);
        h.push_back(key.to_owned());
        while h.len() > self.slots.max(1) {
            h.pop_front();
        }
    }

    /// Those of `live` known to hold adapter `key`.
    pub fn holders(&self, key: &str, live: &[u64]) -> Vec<u64> {
        let held = self.held.lock();
        live.iter()
            .copied()
            .filter(|w| held.get(w).is_some_and(|h| h.iter().any(|k| k == key)))
            .collect()
    }
}
