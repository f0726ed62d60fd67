//! The one place the CPU backend calls the `gemm` crate, whose entry point takes raw pointers
//! and strides. [`matmul`] takes slices and strides instead and checks that every element the
//! product touches lies inside its slice, so the rest of the backend is safe code.

#![allow(unsafe_code)]

/// A strided view: element `(i, j)` is at `i * rs + j * cs`.
#[derive(Debug, Clone, Copy)]
pub struct Strides {
    pub rs: usize,
    pub cs: usize,
}

impl Strides {
    /// Row-major with rows `ld` apart.
    pub const fn rows(ld: usize) -> Self {
        Strides { rs: ld, cs: 1 }
    }
    /// Column-major with columns `ld` apart (the transpose of a row-major matrix).
    pub const fn cols(ld: usize) -> Self {
        Strides { rs: 1, cs: ld }
    }
    fn last(self, rows: usize, cols: usize) -> usize {
        (rows - 1) * self.rs + (cols - 1) * self.cs
    }
}

/// `dst[m×n] (+)= a[m×k] · b[k×n]`, single-threaded (callers parallelise over tiles).
///
/// # Panics
/// If a view reaches past its slice (a bug in the caller, never input-dependent).
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [f32],
    ds: Strides,
    accumulate: bool,
    a: &[f32],
    as_: Strides,
    b: &[f32],
    bs: Strides,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                for j in 0..n {
                    dst[i * ds.rs + j * ds.cs] = 0.0;
                }
            }
        }
        return;
    }
    assert!(ds.last(m, n) < dst.len(), "matmul: dst view out of bounds");
    assert!(as_.last(m, k) < a.len(), "matmul: lhs view out of bounds");
    assert!(bs.last(k, n) < b.len(), "matmul: rhs view out of bounds");
    // SAFETY: the asserts above keep every element of each view inside its slice; `dst` is
    // borrowed mutably and does not alias `a` or `b` (distinct borrows).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            ds.cs as isize,
            ds.rs as isize,
            accumulate,
            a.as_ptr(),
            as_.cs as isize,
            as_.rs as isize,
            b.as_ptr(),
            bs.cs as isize,
            bs.rs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_definition_for_any_strides() {
        let (m, n, k) = (3, 5, 4);
        let a: Vec<f32> = (0..m * k).map(|x| x as f32 * 0.5 - 2.0).collect();
        let b: Vec<f32> = (0..k * n).map(|x| (x % 7) as f32 - 3.0).collect();
        let mut want = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                want[i * n + j] = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
            }
        }
        let mut c = vec![0.0; m * n];
        matmul(
            m,
            n,
            k,
            &mut c,
            Strides::rows(n),
            false,
            &a,
            Strides::rows(k),
            &b,
            Strides::rows(n),
        );
        assert_eq!(c, want);
        // b given transposed (n×k row-major), dst column-major.
        let bt: Vec<f32> = (0..n * k).map(|x| b[(x % k) * n + x / k]).collect();
        let mut ct = vec![0.0; m * n];
        matmul(
            m,
            n,
            k,
            &mut ct,
            Strides::cols(m),
            false,
            &a,
            Strides::rows(k),
            &bt,
            Strides::cols(k),
        );
        for i in 0..m {
            for j in 0..n {
                assert_eq!(ct[j * m + i], want[i * n + j]);
            }
        }
        // Accumulate adds.
        matmul(
            m,
            n,
            k,
            &mut c,
            Strides::rows(n),
            true,
            &a,
            Strides::rows(k),
            &b,
            Strides::rows(n),
        );
        assert_eq!(c, want.iter().map(|x| 2.0 * x).collect::<Vec<_>>());
    }
}
