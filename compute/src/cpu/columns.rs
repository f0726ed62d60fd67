//! Parallel writes into disjoint column ranges of one row-major matrix.
//!
//! A matrix product is split among threads by output features, i.e. by columns of the
//! row-major `[rows, cols]` result, so each task's outputs are a strided band that slices
//! cannot express. Without this the tasks wrote private blocks that a second parallel pass
//! copied into place, one more fork-join and one more pass over the outputs per product.
//! [`by_bands`] hands each task a [`Band`] whose rows it may borrow one at a time; bands are
//! disjoint by construction (one per index of a parallel range), which is what makes the
//! raw-pointer view below sound.

#![allow(unsafe_code)]

use std::marker::PhantomData;
use std::ops::Range;

use rayon::prelude::*;

/// Columns `cols` of every row of a `[rows, ld]` matrix, borrowed mutably.
pub struct Band<'a> {
    ptr: *mut f32,
    rows: usize,
    ld: usize,
    cols: Range<usize>,
    _y: PhantomData<&'a mut [f32]>,
}

impl Band<'_> {
    /// This band's columns (in the whole matrix).
    pub fn cols(&self) -> Range<usize> {
        self.cols.clone()
    }

    /// Row `i`'s part of the band. One row at a time: the borrow holds the band.
    ///
    /// # Panics
    /// When `i` is not a row.
    pub fn row(&mut self, i: usize) -> &mut [f32] {
        assert!(i < self.rows, "band row {i} of {}", self.rows);
        // SAFETY: `by_bands` made `ptr` from a `&mut [f32]` of `rows · ld` values that it
        // borrows for `'a`, with `cols.end ≤ ld`, so the range lies inside it; no other band
        // shares these columns, and `&mut self` keeps this band's rows from aliasing.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.ptr.add(i * self.ld + self.cols.start),
                self.cols.len(),
            )
        }
    }
}

/// The matrix's pointer, shared by the tasks; each turns it into its own band only.
struct Shared(*mut f32);
// SAFETY: the tasks write disjoint bands (see `Band::row`).
unsafe impl Sync for Shared {}

/// Split the columns of `y` (`[rows, ld]`) into bands of `width` (the last may be
/// narrower) and run `f(band index, band)` for each in parallel.
///
/// # Panics
/// When `y` is not `rows · ld` long or `width` is 0.
pub fn by_bands<F>(y: &mut [f32], rows: usize, ld: usize, width: usize, f: F)
where
    F: Fn(usize, Band<'_>) + Sync + Send,
{
    assert_eq!(y.len(), rows * ld, "band matrix size");
    assert!(width > 0, "band width 0");
    let shared = Shared(y.as_mut_ptr());
    let shared = &shared;
    (0..ld.div_ceil(width)).into_par_iter().for_each(|b| {
        let cols = b * width..((b + 1) * width).min(ld);
        f(
            b,
            Band {
                ptr: shared.0,
                rows,
                ld,
                cols,
                _y: PhantomData,
            },
        )
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bands_cover_every_column_once() {
        for (rows, ld, width) in [(1, 1, 1), (3, 10, 4), (5, 96, 48), (2, 100, 48), (4, 7, 9)] {
            let mut y = vec![0.0f32; rows * ld];
            by_bands(&mut y, rows, ld, width, |b, mut band| {
                assert_eq!(band.cols().start, b * width);
                for i in 0..rows {
                    let cols = band.cols();
                    for (j, v) in band.row(i).iter_mut().enumerate() {
                        *v += (i * ld + cols.start + j) as f32;
                    }
                }
            });
            let want: Vec<f32> = (0..rows * ld).map(|v| v as f32).collect();
            assert_eq!(y, want, "rows {rows} ld {ld} width {width}");
        }
    }
}
