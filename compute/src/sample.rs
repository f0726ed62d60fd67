//! Choosing the next token from logits: greedy, or temperature with min-p, top-k and top-p,
//! drawn from a generator seeded by the request's seed and the token's position; before that,
//! [`Penalties`] (logit bias, repetition, frequency and presence penalties) adjust the logits.
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
    /// Drop the tokens less likely than `min_p` times the most likely one (after
    /// temperature); 0 keeps all.
    pub min_p: f32,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 0,
        }
    }
}

/// What a request's earlier tokens and its logit bias do to the logits, as vLLM (and OpenAI,
/// and Hugging Face's `repetition_penalty`) define them, applied in this order:
/// - `logit_bias`: added to its tokens' logits;
/// - `repetition`: a logit of a token in the prompt or the output so far is divided by it
///   when positive, multiplied when negative (1: off);
/// - `frequency`: subtracted once per time the token occurs in the output so far;
/// - `presence`: subtracted once if the token occurs in the output so far.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Penalties {
    pub logit_bias: Vec<(u32, f32)>,
    pub repetition: f32,
    pub frequency: f32,
    pub presence: f32,
}

impl Penalties {
    /// `None` when nothing would change a logit, so the common request pays nothing.
    pub fn any(self) -> Option<Self> {
        let off = self.logit_bias.is_empty()
            && (self.repetition == 1.0 || self.repetition <= 0.0)
            && self.frequency == 0.0
            && self.presence == 0.0;
        (!off).then_some(self)
    }

    /// Adjust `logits` for a sequence whose `prompt` and `output` so far are these. Token ids
    /// outside the vocabulary are ignored.
    pub fn apply(&self, logits: &mut [f32], prompt: &[u32], output: &[u32]) {
        for &(t, bias) in &self.logit_bias {
            if let Some(l) = logits.get_mut(t as usize) {
                *l += bias;
            }
        }
        if self.repetition != 1.0 && self.repetition > 0.0 {
            let mut seen = std::collections::HashSet::with_capacity(prompt.len() + output.len());
            for &t in prompt.iter().chain(output) {
                if seen.insert(t)
                    && let Some(l) = logits.get_mut(t as usize)
                {
                    *l = if *l > 0.0 {
                        *l / self.repetition
                    } else {
                        *l * self.repetition
                    };
                }
            }
        }
        if self.frequency != 0.0 || self.presence != 0.0 {
            let mut counts = std::collections::HashMap::<u32, u32>::with_capacity(output.len());
            for &t in output {
                *counts.entry(t).or_default() += 1;
            }
            for (t, n) in counts {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l -= self.frequency * n as f32 + self.presence;
                }
            }
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

/// `e^((x - max) / t)`, what a logit weighs (0 for -∞ and NaN).
#[inline(always)]
fn weight(x: f32, max: f32, t: f32) -> f32 {
    let w = crate::cpu::math::exp((x - max) / t);
    if w.is_nan() { 0.0 } else { w }
}

/// Σ of [`weight`] over `logits` (one vectorized pass over the vocabulary, sixteen lanes).
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512bw",
    "x86_64+avx2+fma",
    "aarch64+neon"
))]
fn total_weight(logits: &[f32], max: f32, t: f32) -> f64 {
    let mut lanes = [0.0f32; 16];
    let mut chunks = logits.chunks_exact(16);
    for c in &mut chunks {
        for (l, x) in lanes.iter_mut().zip(c) {
            *l += weight(*x, max, t);
        }
    }
    let tail: f32 = chunks.remainder().iter().map(|x| weight(*x, max, t)).sum();
    lanes.iter().map(|l| f64::from(*l)).sum::<f64>() + f64::from(tail)
}

/// Candidates with finite logits, by descending logit (ties by id).
fn order(logits: &[f32]) -> impl Fn(&u32, &u32) -> std::cmp::Ordering + '_ {
    |a, b| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    }
}

/// The first token at which the running sum of [`weight`]s in id order passes `r`, sixteen
/// weights at a time; `None` when rounding leaves `r` past the end.
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512bw",
    "x86_64+avx2+fma",
    "aarch64+neon"
))]
fn walk(logits: &[f32], max: f32, t: f32, mut r: f64) -> Option<u32> {
    let mut w = [0.0f32; 16];
    for (c, chunk) in logits.chunks(16).enumerate() {
        let w = &mut w[..chunk.len()];
        for (w, x) in w.iter_mut().zip(chunk) {
            *w = weight(*x, max, t);
        }
        let sum: f64 = w.iter().map(|v| f64::from(*v)).sum();
        if r < sum {
            for (j, v) in w.iter().enumerate() {
                if r < f64::from(*v) {
                    return Some((c * 16 + j) as u32);
                }
                r -= f64::from(*v);
            }
        } else {
            r -= sum;
        }
    }
    None
}

/// `ln Σ e^l` over the logits (accumulated in f64): a token's log-probability is its logit
/// minus this.
pub fn logsumexp(logits: &[f32]) -> f32 {
    let max = logits[argmax(logits) as usize];
    if !max.is_finite() {
        return max;
    }
    let sum: f64 = logits
        .iter()
        .map(|&x| f64::from(x - max).exp())
        .filter(|w| !w.is_nan())
        .sum();
    max + sum.ln() as f32
}

/// The `n` most likely token ids, best first (ties by id); NaN never counts.
pub fn top_n(logits: &[f32], n: usize) -> Vec<u32> {
    if n == 0 {
        return Vec::new();
    }
    let by_logit = order(logits);
    let mut idx: Vec<u32> = (0..logits.len() as u32)
        .filter(|&i| !logits[i as usize].is_nan())
        .collect();
    let n = n.min(idx.len());
    if n == 0 {
        return Vec::new();
    }
    if n < idx.len() {
        idx.select_nth_unstable_by(n - 1, &by_logit);
        idx.truncate(n);
    }
    idx.sort_unstable_by(&by_logit);
    idx
}

/// The token at `position` (the sequence length before it) for these logits.
///
/// With no cut (`top_k` 0, `top_p` 1) the seeded draw walks the vocabulary in id order —
/// two vectorized passes, normalizer and walk; any fixed order draws from the same
/// distribution. With a cut, the candidates are ranked by logit (ties by id), cut to
/// `top_k`, then to the nucleus (the shortest head holding `top_p` of the probability), and
/// the draw walks them in rank order. Only as much of the ranking as the draw and the
/// nucleus reach is built: the best 64 are selected (linear time) and sorted, eight times
/// more whenever the walk runs past them. A full sort of a 49,152-token vocabulary cost ~2 ms
/// per sampled token, serially on the engine thread; selections of a flat distribution's
/// head, 9 % of a 16-stream step.
pub fn sample(logits: &[f32], p: &SamplingParams, position: u64) -> u32 {
    if p.temperature <= 0.0 || p.top_k == 1 || logits.len() < 2 {
        return argmax(logits);
    }
    if p.min_p > 0.0 {
        // p_i < min_p · p_max  ⇔  l_i < l_max + t · ln(min_p): those leave the vocabulary.
        let floor = logits[argmax(logits) as usize] + p.temperature * p.min_p.min(1.0).ln();
        let cut: Vec<f32> = logits
            .iter()
            .map(|&l| if l >= floor { l } else { f32::NEG_INFINITY })
            .collect();
        let rest = SamplingParams { min_p: 0.0, ..*p };
        return sample(&cut, &rest, position);
    }
    if (p.top_k == 0 || p.top_k >= logits.len()) && p.top_p >= 1.0 {
        let (t, max) = (p.temperature, logits[argmax(logits) as usize]);
        let r = uniform(p.seed, position) * total_weight(logits, max, t);
        // Past the end by rounding: the last token that weighs anything.
        return walk(logits, max, t, r).unwrap_or_else(|| {
            let last = logits.iter().rposition(|x| weight(*x, max, t) > 0.0);
            last.map_or_else(|| argmax(logits), |i| i as u32)
        });
    }
    let by_logit = order(logits);
    let mut idx: Vec<u32> = (0..logits.len() as u32)
        .filter(|&i| logits[i as usize].is_finite())
        .collect();
    if idx.is_empty() {
        return argmax(logits);
    }
    let t = p.temperature;
    let max = logits[argmax(logits) as usize];
    let total = if p.top_k > 0 && p.top_k < idx.len() {
        idx.select_nth_unstable_by(p.top_k - 1, &by_logit);
        idx.truncate(p.top_k);
        idx.iter()
            .map(|&i| f64::from(weight(logits[i as usize], max, t)))
            .sum()
    } else {
        total_weight(logits, max, t)
    };
    let prob = |i: u32| f64::from(weight(logits[i as usize], max, t)) / total;
    let r = uniform(p.seed, position);
    let mut k = 64.min(idx.len());
    loop {
        if k < idx.len() {
            idx.select_nth_unstable_by(k - 1, &by_logit);
        }
        let head = &mut idx[..k];
        head.sort_unstable_by(&by_logit);
        let whole = k == idx.len();
        let head = &idx[..k];
        // The nucleus's share of the whole: the draw is scaled into it.
        let mass = if p.top_p < 1.0 {
            let mut acc = 0.0;
            match head.iter().position(|&i| {
                acc += prob(i);
                acc >= f64::from(p.top_p)
            }) {
                Some(n) => Some((n + 1, acc)),
                None if whole => Some((k, acc)),
                None => None,
            }
        } else {
            Some((k, 1.0))
        };
        if let Some((n, mass)) = mass {
            let mut r = r * mass;
            for &i in &head[..n] {
                let x = prob(i);
                if r < x {
                    return i;
                }
                r -= x;
            }
            if whole || n < k {
                return head[n - 1];
            }
        }
        k = (k * 8).min(idx.len());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: usize, top_p: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p: 0.0,
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

    /// The definition: with no cut, walk the vocabulary in id order; otherwise rank every
    /// candidate, cut, renormalize, walk.
    fn sample_sorted(logits: &[f32], p: &SamplingParams, position: u64) -> u32 {
        if p.temperature <= 0.0 || p.top_k == 1 || logits.len() < 2 {
            return argmax(logits);
        }
        let (t, max) = (p.temperature, logits[argmax(logits) as usize]);
        if (p.top_k == 0 || p.top_k >= logits.len()) && p.top_p >= 1.0 {
            let w: Vec<f64> = logits
                .iter()
                .map(|x| f64::from(weight(*x, max, t)))
                .collect();
            let mut r = uniform(p.seed, position) * total_weight(logits, max, t);
            for (i, x) in w.iter().enumerate() {
                if r < *x {
                    return i as u32;
                }
                r -= x;
            }
            return w.iter().rposition(|x| *x > 0.0).unwrap() as u32;
        }
        let by_logit = order(logits);
        let mut idx: Vec<u32> = (0..logits.len() as u32)
            .filter(|&i| logits[i as usize].is_finite())
            .collect();
        idx.sort_unstable_by(&by_logit);
        if p.top_k > 0 {
            idx.truncate(p.top_k);
        }
        let w: Vec<f64> = idx
            .iter()
            .map(|&i| f64::from(weight(logits[i as usize], max, t)))
            .collect();
        let total = if p.top_k > 0 && p.top_k < logits.len() {
            w.iter().sum()
        } else {
            total_weight(logits, max, t)
        };
        let probs: Vec<f64> = w.iter().map(|x| x / total).collect();
        let mut keep = probs.len();
        let mut mass = 1.0;
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            for (j, x) in probs.iter().enumerate() {
                acc += x;
                if acc >= f64::from(p.top_p) {
                    keep = j + 1;
                    break;
                }
            }
            mass = probs[..keep].iter().sum();
        }
        let mut r = uniform(p.seed, position) * mass;
        for (j, x) in probs[..keep].iter().enumerate() {
            if r < *x {
                return idx[j];
            }
            r -= x;
        }
        idx[keep - 1]
    }

    /// The partial ranking (and the id-order walk) draw exactly what the definition draws, flat or peaked
    /// distributions, with and without top-k and top-p, over a real vocabulary's size.
    #[test]
    fn partial_ranking_draws_what_the_full_ranking_draws() {
        for (n, spread) in [(50usize, 0.5f32), (5000, 4.0), (49152, 12.0), (49152, 0.01)] {
            let logits: Vec<f32> = (0..n)
                .map(|i| ((splitmix(i as u64) >> 40) as f32 / (1u64 << 24) as f32) * spread)
                .collect();
            for (t, k, tp) in [
                (1.0, 0, 1.0),
                (0.7, 0, 0.9),
                (1.3, 40, 1.0),
                (1.0, 100, 0.5),
                (2.0, 0, 0.999),
            ] {
                let prm = SamplingParams {
                    temperature: t,
                    top_k: k,
                    top_p: tp,
                    min_p: 0.0,
                    seed: 3,
                };
                for pos in 0..40 {
                    assert_eq!(
                        sample(&logits, &prm, pos),
                        sample_sorted(&logits, &prm, pos),
                        "n={n} spread={spread} {prm:?} pos={pos}"
                    );
                }
            }
        }
    }

    #[test]
    fn min_p_drops_what_is_less_likely_than_its_share_of_the_best() {
        // Probabilities ∝ e^l at temperature 1: 1, e^-0.5 ≈ 0.61, e^-1 ≈ 0.37, e^-3 ≈ 0.05.
        let logits = [0.0, -0.5, -1.0, -3.0];
        let drawn = |min_p: f32, t: f32| -> std::collections::BTreeSet<u32> {
            (0..2000)
                .map(|pos| {
                    let p = SamplingParams {
                        min_p,
                        ..params(t, 0, 1.0)
                    };
                    sample(&logits, &p, pos)
                })
                .collect()
        };
        assert_eq!(
            drawn(0.0, 1.0).into_iter().collect::<Vec<_>>(),
            [0, 1, 2, 3]
        );
        assert_eq!(drawn(0.1, 1.0).into_iter().collect::<Vec<_>>(), [0, 1, 2]);
        assert_eq!(drawn(0.5, 1.0).into_iter().collect::<Vec<_>>(), [0, 1]);
        assert_eq!(drawn(1.0, 1.0).into_iter().collect::<Vec<_>>(), [0]);
        // After temperature: at t = 2, token 2 weighs e^-0.5 ≈ 0.61 of the best.
        assert_eq!(drawn(0.5, 2.0).into_iter().collect::<Vec<_>>(), [0, 1, 2]);
    }

    /// The penalties against their definitions, token by token, on a six-token vocabulary.
    #[test]
    fn penalties_equal_their_definitions() {
        let logits = [2.0f32, -1.0, 0.5, 3.0, -2.0, 1.0];
        let prompt = [0u32, 1];
        let output = [2u32, 2, 1, 3, 2];
        let p = Penalties {
            logit_bias: vec![(5, -4.0), (4, 10.0), (99, 1.0)],
            repetition: 1.3,
            frequency: 0.25,
            presence: 0.5,
        };
        let mut got = logits;
        p.apply(&mut got, &prompt, &output);
        // Output counts: token 1 once, 2 three times, 3 once; 0 only in the prompt.
        let count = |t: u32| output.iter().filter(|&&x| x == t).count() as f32;
        let want: Vec<f32> = (0..6u32)
            .map(|t| {
                let mut l = logits[t as usize];
                l += p
                    .logit_bias
                    .iter()
                    .filter(|b| b.0 == t)
                    .map(|b| b.1)
                    .sum::<f32>();
                if prompt.contains(&t) || output.contains(&t) {
                    l = if l > 0.0 { l / 1.3 } else { l * 1.3 };
                }
                if output.contains(&t) {
                    l -= 0.25 * count(t) + 0.5;
                }
                l
            })
            .collect();
        assert_eq!(got.to_vec(), want);
        assert_eq!(
            got,
            [
                2.0 / 1.3,
                -1.3 - 0.75,
                0.5 / 1.3 - 1.25,
                3.0 / 1.3 - 0.75,
                8.0,
                -3.0
            ]
        );
        // Neutral settings change nothing and cost nothing.
        let neutral = Penalties {
            repetition: 1.0,
            ..Penalties::default()
        };
        assert_eq!(neutral.any(), None);
        // A penalty steers greedy decoding away from a repeated token.
        let mut l = [1.0f32, 0.9];
        Penalties {
            presence: 0.2,
            ..Penalties::default()
        }
        .apply(&mut l, &[], &[0]);
        assert_eq!(argmax(&l), 1);
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
