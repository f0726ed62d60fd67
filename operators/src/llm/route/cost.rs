//! The `kv` policy's price of each worker for one prompt.
//!
//! [`candidates`] prices each worker as Dynamo's KV router does:
//! `overlap_weight × (prompt blocks − blocks already cached there) + decode blocks`, the
//! decode blocks being those active there plus the prompt's blocks not among them,
//! and [`choose`] takes the cheapest (ties: fewer active requests, then at random), or with
//! `temperature > 0` samples from a softmax over the costs normalised to `0..=1`.

use rand::Rng;
use serde::{Deserialize, Serialize};

use super::sequences::{ActiveSequences, Load};

/// One worker's terms for one prompt: the decision and what `dyn inspect route` shows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Candidate {
    pub worker: u64,
    /// Leading prompt blocks the worker already caches.
    pub matched_blocks: usize,
    /// Prompt blocks it would have to prefill.
    pub prefill_blocks: usize,
    pub load: Load,
    pub cost: f64,
}

/// Price every live worker for a prompt whose block hashes are `hashes` (`prompt_blocks`
/// blocks, counting a last partial one), given the indexer's matches (workers with none are
/// absent) and the active sequences.
pub fn candidates(
    workers: &[u64],
    matches: &[(u64, usize)],
    hashes: &[u64],
    prompt_blocks: usize,
    overlap_weight: f64,
    active: &ActiveSequences,
) -> Vec<Candidate> {
    workers
        .iter()
        .map(|&w| {
            let matched = matches
                .iter()
                .find(|(id, _)| *id == w)
                .map_or(0, |(_, n)| (*n).min(prompt_blocks));
            let (mut load, new_blocks) = active.load_and_new_blocks(w, hashes);
            load.decode_blocks += (new_blocks + prompt_blocks - hashes.len()) as u64;
            let prefill_blocks = prompt_blocks - matched;
            Candidate {
                worker: w,
                matched_blocks: matched,
                prefill_blocks,
                load,
                cost: overlap_weight * prefill_blocks as f64 + load.decode_blocks as f64,
            }
        })
        .collect()
}

/// The index of the chosen candidate; `None` without candidates.
pub fn choose(c: &[Candidate], temperature: f64, rng: &mut impl Rng) -> Option<usize> {
    if c.is_empty() {
        return None;
    }
    if temperature > 0.0 {
        let (lo, hi) = c.iter().fold((f64::MAX, f64::MIN), |(lo, hi), x| {
            (lo.min(x.cost), hi.max(x.cost))
        });
        let span = if hi > lo { hi - lo } else { 1.0 };
        let weights: Vec<f64> = c
            .iter()
            .map(|x| (-((x.cost - lo) / span) / temperature).exp())
            .collect();
        let total: f64 = weights.iter().sum();
        let mut r = rng.random::<f64>() * total;
        for (i, w) in weights.iter().enumerate() {
            if r < *w {
                return Some(i);
            }
            r -= w;
        }
        return Some(c.len() - 1);
    }
    let best = c.iter().map(|x| x.cost).fold(f64::MAX, f64::min);
    let tied: Vec<usize> = (0..c.len()).filter(|&i| c[i].cost <= best).collect();
    let fewest = tied.iter().map(|&i| c[i].load.requests).min()?;
    let tied: Vec<usize> = tied
        .into_iter()
        .filter(|&i| c[i].load.requests == fewest)
        .collect();
    Some(tied[rng.random_range(0..tied.len())])
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;
    use std::sync::Arc;

    #[test]
    fn cost_is_uncached_prefill_plus_decode_blocks() {
        let active = Arc::new(ActiveSequences::default());
        // Worker 2 decodes a request holding blocks 100..130 and the prompt's first two.
        let mut held: Vec<u64> = (100..130).collect();
        held.extend([1, 2]);
        let _busy = active.start(2, 0, held);
        let prompt: Vec<u64> = (1..=10).collect();
        let c = candidates(&[1, 2, 3], &[(1, 2), (2, 10)], &prompt, 10, 1.5, &active);
        let costs: Vec<f64> = c.iter().map(|c| c.cost).collect();
        // w1: 1.5 × 8 + 10 new; w2: 0 + 32 active + 8 new; w3: 1.5 × 10 + 10.
        assert_eq!(costs, [22.0, 40.0, 25.0]);
        assert_eq!(c[1].matched_blocks, 10);
        assert_eq!(c[1].load.decode_blocks, 40);
        let mut rng = StdRng::seed_from_u64(0);
        assert_eq!(choose(&c, 0.0, &mut rng), Some(0));
    }

    #[test]
    fn ties_go_to_fewer_requests_then_random() {
        let active = Arc::new(ActiveSequences::default());
        let _a = active.start(1, 0, Vec::new());
        let c = candidates(&[1, 2, 3], &[], &[7; 4], 4, 1.0, &active);
        assert!(c.iter().all(|c| c.cost == 8.0), "{c:?}");
        let mut rng = StdRng::seed_from_u64(1);
        let mut picked = std::collections::HashSet::new();
        for _ in 0..50 {
            picked.insert(c[choose(&c, 0.0, &mut rng).unwrap()].worker);
        }
        assert_eq!(
            picked,
            [2, 3].into(),
            "worker 1 has a request; 2 and 3 split the rest"
        );
        assert_eq!(choose(&[], 0.0, &mut rng), None);
    }

    #[test]
    fn temperature_samples_cheaper_workers_more_often() {
        let active = Arc::new(ActiveSequences::default());
        // Costs 0 + 8 and 8 + 8.
        let c = candidates(&[1, 2], &[(1, 8)], &[0; 8], 8, 1.0, &active);
        let mut rng = StdRng::seed_from_u64(2);
        let n = 10_000;
        let first = (0..n)
            .filter(|_| choose(&c, 0.5, &mut rng) == Some(0))
            .count() as f64
            / n as f64;
        // Normalised costs 0 and 1: weights 1 and e^-2, so p = 1 / (1 + e^-2) ≈ 0.881.
        assert!((first - 0.881).abs() < 0.02, "{first}");
    }
}
