//! LoRA adapters in the CPU backend's step: after (or, for the gated MLP, inside) each
//! projection of the base, every token row whose sequence has an adapter gets that adapter's
//! addition. Rows are independent, so a batch mixing adapters (and rows without one) is one
//! pass over the rows in parallel, each reading its own adapter's `A` and `B`; the base's
//! product stays one matrix product for the whole batch.
//!
//! The cost per row is `rank · (in + out)` multiply-adds per changed projection: a few per
//! cent of the base's `in · out` at the ranks adapters use.

use rayon::prelude::*;

use crate::backend::SeqStep;
use crate::model::lora::{LoraAdapter, Target};

/// The adapter of each token row of a step's flattened batch.
pub(super) struct Rows<'a> {
    per_row: Vec<Option<&'a LoraAdapter>>,
    any: bool,
}

impl<'a> Rows<'a> {
    pub fn of(batch: &[SeqStep<'a>]) -> Self {
        let per_row: Vec<Option<&LoraAdapter>> = batch
            .iter()
            .flat_map(|s| std::iter::repeat_n(s.lora, s.tokens.len()))
            .collect();
        let any = per_row.iter().any(Option::is_some);
        Rows { per_row, any }
    }

    /// Whether any row's adapter changes projection `t` of layer `layer`.
    pub fn changes(&self, layer: usize, t: Target) -> bool {
        self.any
            && self
                .per_row
                .iter()
                .flatten()
                .any(|a| a.pair(layer, t).is_some())
    }

    /// For each row with an adapter that changes `t` in `layer`: `y[row][off..off + out] +=`
    /// its addition for `x[row]` (`inp` values per row; `y` rows `stride` apart).
    #[allow(clippy::too_many_arguments)]
    pub fn add(
        &self,
        layer: usize,
        t: Target,
        x: &[f32],
        inp: usize,
        y: &mut [f32],
        stride: usize,
        off: usize,
    ) {
        if !self.changes(layer, t) {
            return;
        }
        y.par_chunks_exact_mut(stride)
            .zip(x.par_chunks_exact(inp))
            .zip(self.per_row.par_iter())
            .with_min_len(8)
            .for_each_init(Vec::new, |u, ((y, x), a)| {
                if let Some(p) = a.and_then(|a| a.pair(layer, t)) {
                    p.add_row(x, &mut y[off..off + p.out], u);
                }
            });
    }
}
