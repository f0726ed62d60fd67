//! Choosing the next token from logits: greedy, or temperature with top-k and top-p, drawn
//! from a generator seeded by the request's seed and the token's position.
//!
//! Seeding by position (not by a generator that advances) makes a sequence's output a pure
//! function of its seed and its tokens: the same whether it ran alone or batched, was
//! preempted and recomputed, or migrated to another worker mid-answer.

/// How to sample; `temperature <= 0` (or `top_k == 1`) is greedy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 keeps all.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p`.
    pub top_p: f32,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

/// The most likely token (the lowest id among equals); NaN never wins.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    let mut max = f32::NEG_INFINITY;
    for (i, &x) in logits.iter().enumerate() {
        if x > max {
            max = x;
            best = i;
        }
    }
    best as u32
}

/// splitmix64's output function: a well-mixed 64-bit value from any 64-bit input.
pub fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A uniform draw in `[0, 1)` for `seed` at `position`.
fn uniform(seed: u64, position: u64) -> f64 {
    let z = splitmix(splitmix(seed) ^ position.wrapping_mul(0xD1B5_4A32_D192_ED03));
    (z >> 11) as f64 / (1u64 << 53) as f64
}

/// The token at `position` (the sequence length before it) for these logits.
pub fn sample(logits: &[f32], p: &SamplingParams, position: u64) -> u32 {
    if p.temperature <= 0.0 || p.top_k == 1 || logits.len() < 2 {
        return argmax(logits);
    }
    // Candidates by descending logit (ties by id), cut to top-k.
    let mut idx: Vec<u32> = (0..logits.len() as u32)
        .filter(|&i| logits[i as usize].is_finite())
        .collect();
    if idx.is_empty() {
        return argmax(logits);
    }
    let by_logit = |a: &u32, b: &u32| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    };
    if p.top_k > 0 && p.top_k < idx.len() {
        idx.select_nth_unstable_by(p.top_k - 1, by_logit);
        idx.truncate(p.top_k);
    }
    idx.sort_unstable_by(by_logit);
    let max = logits[idx[0] as usize];
    let mut probs: Vec<f64> = idx
        .iter()
        .map(|&i| (((logits[i as usize] - max) / p.temperature) as f64).exp())
        .collect();
    let total: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|x| *x /= total);
    if p.top_p < 1.0 {
        let mut acc = 0.0;
        let keep = probs
            .iter()
            .position(|x| {
                acc += x;
                acc >= f64::from(p.top_p)
            })
            .map_or(probs.len(), |i| i + 1);
        probs.truncate(keep);
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= total);
    }
    let mut r = uniform(p.seed, position);
    for (i, x) in probs.iter().enumerate() {
        if r < *x {
            return idx[i];
        }
        r -= x;
    }
    idx[probs.len() - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: usize, top_p: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            seed: 7,
        }
    }

    #[test]
    fn greedy_takes_the_first_maximum() {
        assert_eq!(sample(&[0.1, 3.0, 3.0, -1.0], &params(0.0, 0, 1.0), 0), 1);
        assert_eq!(argmax(&[f32::NAN, 1.0]), 1);
    }

    #[test]
    fn top_k_and_top_p_keep_only_the_likely_tokens() {
        let logits = [5.0, 4.9, 4.8, -3.0, 1.0];
        for pos in 0..200 {
            assert!(sample(&logits, &params(1.0, 2, 1.0), pos) < 2);
            // The first two tokens hold ~0.68 of the mass: top_p 0.5 keeps the first two.
            assert!(sample(&logits, &params(1.0, 0, 0.5), pos) < 2);
        }
        let seen: std::collections::BTreeSet<u32> = (0..500)
            .map(|pos| sample(&logits, &params(1.0, 3, 1.0), pos))
            .collect();
        assert_eq!(seen.into_iter().collect::<Vec<_>>(), [0, 1, 2]);
    }

    #[test]
    fn same_seed_and_position_give_the_same_token() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let a: Vec<u32> = (0..20)
            .map(|pos| sample(&logits, &params(0.8, 0, 0.95), pos))
            .collect();
        let b: Vec<u32> = (0..20)
            .map(|pos| sample(&logits, &params(0.8, 0, 0.95), pos))
            .collect();
        assert_eq!(a, b);
        let other = SamplingParams {
            seed: 8,
            ..params(0.8, 0, 0.95)
        };
        let c: Vec<u32> = (0..20).map(|pos| sample(&logits, &other, pos)).collect();
        assert_ne!(a, c);
    }
}
