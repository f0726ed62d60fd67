//! LoRA adapters in the CPU backend's step: after (or, for the gated MLP, inside) each
//! projection of the base, every token row whose sequence has an adapter gets that adapter's
//! addition, so a batch mixing adapters (and rows without one) runs the base's product once
//! for all rows.
//!
//! The rows of each adapter are gathered and multiplied as small matrices — `U = X · Aᵀ`
//! (`[rows, rank]`), then `D = U · Bᵀ` (`[rows, out]`) — by gemm's microkernels, in tasks of a
//! few rows spread over the threads; a last parallel pass adds each row's `D` into its output
//! row. A row's cost is `rank · (in + out)` multiply-adds per changed projection: a few per
//! cent of the base's `in · out` at the ranks adapters use.

use rayon::prelude::*;

use super::gemm::{Strides, matmul};
use crate::backend::SeqStep;
use crate::model::lora::{LoraAdapter, LoraPair, Target};

/// The adapters of a step's flattened batch, each with its token rows.
pub(super) struct Rows<'a> {
    groups: Vec<(&'a LoraAdapter, Vec<usize>)>,
    /// Rows in the step.
    rows: usize,
}

/// Rows a task multiplies at least (fewer only when the adapter has fewer).
const TASK_ROWS: usize = 4;

/// One task's rows and their additions (`[rows, out]`).
struct Task<'p> {
    pair: &'p LoraPair,
    rows: Vec<usize>,
    d: Vec<f32>,
}

impl<'a> Rows<'a> {
    pub fn of(batch: &[SeqStep<'a>]) -> Self {
        let mut groups: Vec<(&LoraAdapter, Vec<usize>)> = Vec::new();
        let mut at = 0;
        for s in batch {
            let rows = at..at + s.tokens.len();
            at = rows.end;
            let Some(a) = s.lora else { continue };
            match groups.iter_mut().find(|(g, _)| std::ptr::eq(*g, a)) {
                Some((_, r)) => r.extend(rows),
                None => groups.push((a, rows.collect())),
            }
        }
        Rows { groups, rows: at }
    }

    /// Whether any row's adapter changes projection `t` of layer `layer`.
    pub fn changes(&self, layer: usize, t: Target) -> bool {
        self.groups.iter().any(|(a, _)| a.pair(layer, t).is_some())
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
        let threads = rayon::current_num_threads().max(1);
        let mut tasks: Vec<Task<'_>> = Vec::new();
        for (a, rows) in &self.groups {
            let Some(pair) = a.pair(layer, t) else {
                continue;
            };
            let per = rows.len().div_ceil(threads).max(TASK_ROWS);
            tasks.extend(rows.chunks(per).map(|r| Task {
                pair,
                rows: r.to_vec(),
                d: Vec::new(),
            }));
        }
        if tasks.is_empty() {
            return;
        }
        tasks.par_iter_mut().for_each(|task| task.run(x, inp));
        // Each row's addition, found by row.
        let mut from: Vec<Option<(usize, usize)>> = vec![None; self.rows];
        for (ti, task) in tasks.iter().enumerate() {
            for (i, &r) in task.rows.iter().enumerate() {
                from[r] = Some((ti, i));
            }
        }
        y.par_chunks_exact_mut(stride)
            .zip(from.par_iter())
            .with_min_len(8)
            .for_each(|(y, from)| {
                if let Some((ti, i)) = *from {
                    let task = &tasks[ti];
                    let out = task.pair.out;
                    let d = &task.d[i * out..(i + 1) * out];
                    y[off..off + out]
                        .iter_mut()
                        .zip(d)
                        .for_each(|(y, d)| *y += d);
                }
            });
    }
}

impl Task<'_> {
    /// `d = (x[rows] · Aᵀ) · Bᵀ`, with the scale in `Bᵀ`.
    fn run(&mut self, x: &[f32], inp: usize) {
        let p = self.pair;
        let n = self.rows.len();
        let mut xg = Vec::with_capacity(n * inp);
        for &r in &self.rows {
            xg.extend_from_slice(&x[r * inp..(r + 1) * inp]);
        }
        let mut u = vec![0.0; n * p.rank];
        let rows = Strides::rows;
        matmul(
            n,
            p.rank,
            inp,
            &mut u,
            rows(p.rank),
            false,
            &xg,
            rows(inp),
            &p.at,
            rows(p.rank),
        );
        self.d = vec![0.0; n * p.out];
        matmul(
            n,
            p.out,
            p.rank,
            &mut self.d,
            rows(p.out),
            false,
            &u,
            rows(p.rank),
            &p.bt,
            rows(p.out),
        );
    }
}
