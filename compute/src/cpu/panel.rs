//! Weight matrices packed for batched decode, and the kernels that multiply them.
//!
//! A decode step multiplies a few input rows (one per sequence) by every weight matrix, so
//! the weights must stream from memory once per step while each value read feeds every row.
//! Row-major weights make each output a dot product along the input, which ends in a
//! horizontal sum per (row, output) and, for the batched case, a transpose; general GEMM
//! kernels pack the weights into panels again at every call. Packing once at load time
//! removes both: the output features are grouped by [`WIDTH`] (three panels of sixteen, one
//! 512-bit register of f32 each), stored input-major inside a group (`[k][48]`), and a kernel
//! keeps a `rows × 3` block of sixteen-lane accumulators in registers while it walks the
//! input once: per input element, three vector loads of weights and one broadcast per row
//! feed `3 × rows` fused multiply-adds, and each accumulator is already sixteen finished
//! outputs of one row. bf16 groups store input pairs side by side (`[k/2][48][2]`), the
//! operand shape of AVX512-BF16's `vdpbf16ps`, which multiplies and adds 32 bf16 pairs per
//! instruction.
//!
//! The kernels are written with AVX-512 intrinsics and picked at run time; other CPUs take a
//! portable version of the same loops (compiled for AVX2 and NEON as well, and chosen at run
//! time). Larger batches (prefill) hand a group, as a `[k][48]` row-major f32 matrix, to
//! gemm (see [`super::linear`]).

#![allow(unsafe_code)]

use std::ops::Range;

use half::{bf16, f16};

use crate::model::Host;

/// Call `f::<T>(args)` for the run-time row count `t` in `1..=8`.
macro_rules! by_rows {
    ($t:expr, $($f:ident)::+, $($a:expr),* $(,)?) => {
        match $t {
            1 => $($f)::+::<1>($($a),*),
            2 => $($f)::+::<2>($($a),*),
            3 => $($f)::+::<3>($($a),*),
            4 => $($f)::+::<4>($($a),*),
            5 => $($f)::+::<5>($($a),*),
            6 => $($f)::+::<6>($($a),*),
            7 => $($f)::+::<7>($($a),*),
            _ => $($f)::+::<8>($($a),*),
        }
    };
}

/// Output features per panel: one 512-bit register of f32.
const LANES: usize = 16;
/// Output features per group: three panels, multiplied together.
pub const WIDTH: usize = 3 * LANES;
/// Input rows per kernel call: with three panels, 24 accumulators and four operands fill
/// the 32 vector registers.
const ROWS: usize = 8;

/// The packed weights.
enum Packed {
    /// `[group][k][48]`.
    F32(Vec<f32>),
    /// `[group][k][48]`.
    F16(Vec<f16>),
    /// `[group][k/2][48][2]`, odd `k` padded with a zero column.
    Bf16(Vec<bf16>),
}

/// A weight matrix `[rows, k]` packed in groups of [`WIDTH`] output features (the last group
/// padded with zero rows).
pub struct Panels {
    pub rows: usize,
    pub k: usize,
    groups: usize,
    data: Packed,
}

/// The input rows as a kernel reads them.
pub enum Input<'a> {
    /// f32 rows `stride` apart (`stride ≥ k`, and even for bf16 weights, padded with zeros).
    F32 { x: &'a [f32], stride: usize },
    /// bf16 rows for `vdpbf16ps`, `stride` (even, `≥ k`) apart, padded with zeros.
    Bf16 { x: &'a [bf16], stride: usize },
}

/// Buffers a caller keeps for [`Panels::input`].
#[derive(Default)]
pub struct InputBuf {
    f: Vec<f32>,
    b: Vec<bf16>,
}

/// Which kernels to run. Only [`Isa::detect`] names instruction sets, and the other
/// constructors only step down from it, so a safe caller cannot ask for kernels this CPU
/// lacks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Isa(Level);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Level {
    Portable,
    Avx512,
    /// AVX-512 with AVX512-BF16.
    Avx512Bf16,
}

impl Isa {
    /// The best this CPU runs.
    pub fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx512f") {
                if std::is_x86_feature_detected!("avx512bf16") {
                    return Isa(Level::Avx512Bf16);
                }
                return Isa(Level::Avx512);
            }
        }
        Isa(Level::Portable)
    }

    /// The portable kernels, on any CPU.
    pub const fn portable() -> Isa {
        Isa(Level::Portable)
    }

    /// The same without AVX512-BF16 (bf16 weights widened to f32 instead).
    pub fn without_bf16(self) -> Isa {
        match self.0 {
            Level::Avx512Bf16 => Isa(Level::Avx512),
            other => Isa(other),
        }
    }
}

impl Panels {
    /// Pack a row-major `[rows, k]` matrix.
    pub fn pack(w: &Host, rows: usize, k: usize) -> Panels {
        let order: Vec<Option<usize>> = (0..rows).map(Some).collect();
        Panels::pack_rows(w, k, &order)
    }

    /// Pack rows of a row-major `[_, k]` matrix in the given order: packed row `r` is `w`'s
    /// row `order[r]`, or zeros for `None` (a product's outputs laid out as its caller
    /// wants them, such as gate and up features side by side).
    ///
    /// # Panics
    /// When `order` names a row `w` does not have.
    pub fn pack_rows(w: &Host, k: usize, order: &[Option<usize>]) -> Panels {
        let rows = order.len();
        let groups = rows.div_ceil(WIDTH);
        let data = match w {
            Host::F32(v) => Packed::F32(by_input(v, k, order, groups, 0.0)),
            Host::F16(v) => Packed::F16(by_input(v, k, order, groups, f16::ZERO)),
            // Quantized weights have their own kernels (`crate::quant`); packed here they
            // are widened.
            Host::Quant(q) => Packed::F32(by_input(&q.to_f32(), k, order, groups, 0.0)),
            Host::Bf16(v) => {
                let k2 = k.div_ceil(2);
                let mut p = vec![bf16::ZERO; groups * k2 * WIDTH * 2];
                for (r, src) in order.iter().enumerate() {
                    let Some(src) = src else { continue };
                    let (g, l) = (r / WIDTH, r % WIDTH);
                    for (c, x) in v[src * k..(src + 1) * k].iter().enumerate() {
                        p[((g * k2 + c / 2) * WIDTH + l) * 2 + c % 2] = *x;
                    }
                }
                Packed::Bf16(p)
            }
        };
        Panels {
            rows,
            k,
            groups,
            data,
        }
    }

    /// Number of groups of [`WIDTH`] output features.
    pub fn groups(&self) -> usize {
        self.groups
    }

    /// `m` rows of `x` (`[m, k]`) as the kernels on `isa` read them: rounded to bf16 once
    /// where the weights are bf16 and the CPU multiplies bf16 pairs, padded to an even
    /// length where pairs of an odd `k` would read past a row.
    pub fn input<'a>(&self, x: &'a [f32], m: usize, isa: Isa, buf: &'a mut InputBuf) -> Input<'a> {
        let k = self.k;
        let Packed::Bf16(_) = self.data else {
            return Input::F32 { x, stride: k };
        };
        let stride = k.div_ceil(2) * 2;
        if isa.0 == Level::Avx512Bf16 {
            buf.b.clear();
            buf.b.resize(m * stride, bf16::ZERO);
            for (row, out) in x.chunks_exact(k).zip(buf.b.chunks_exact_mut(stride)) {
                to_bf16(isa, row, &mut out[..k]);
            }
            return Input::Bf16 { x: &buf.b, stride };
        }
        if stride == k {
            return Input::F32 { x, stride };
        }
        buf.f.clear();
        for row in x.chunks_exact(k).take(m) {
            buf.f.extend_from_slice(row);
            buf.f.push(0.0);
        }
        Input::F32 { x: &buf.f, stride }
    }

    /// `out[t * ld + j] = Σ_c x[t][c] · W[groups.start · 48 + j][c]` for the `m` input rows
    /// and the output features of `groups` (`j < groups.len() × 48`; padding rows give 0).
    ///
    /// # Panics
    /// When `input` was not made by [`Panels::input`] for `m` rows on `isa`, or `out` is too
    /// short (callers' bugs).
    pub fn product(
        &self,
        groups: Range<usize>,
        input: &Input<'_>,
        m: usize,
        isa: Isa,
        out: &mut [f32],
        ld: usize,
    ) {
        assert!(groups.end <= self.groups && ld >= groups.len() * WIDTH);
        if m == 0 || groups.is_empty() {
            return;
        }
        assert!(out.len() >= (m - 1) * ld + groups.len() * WIDTH);
        let k = self.k;
        for (gi, g) in groups.enumerate() {
            for t0 in (0..m).step_by(ROWS) {
                let t = (m - t0).min(ROWS);
                let y = &mut out[t0 * ld + gi * WIDTH..];
                match (&self.data, input) {
                    (Packed::F32(w), Input::F32 { x, stride }) => {
                        let w = &w[g * k * WIDTH..(g + 1) * k * WIDTH];
                        let x = rows_of(x, *stride, t0, t, k);
                        kernel_f32(isa, w, k, x, *stride, t, y, ld);
                    }
                    (Packed::F16(w), Input::F32 { x, stride }) => {
                        let w = &w[g * k * WIDTH..(g + 1) * k * WIDTH];
                        let x = rows_of(x, *stride, t0, t, k);
                        kernel_f16(isa, w, k, x, *stride, t, y, ld);
                    }
                    (Packed::Bf16(w), input) => {
                        let k2 = k.div_ceil(2);
                        let w = &w[g * k2 * WIDTH * 2..(g + 1) * k2 * WIDTH * 2];
                        match input {
                            Input::F32 { x, stride } => {
                                assert!(*stride >= 2 * k2);
                                let x = rows_of(x, *stride, t0, t, 2 * k2);
                                kernel_bf16(isa, w, k2, x, *stride, t, y, ld);
                            }
                            Input::Bf16 { x, stride } => {
                                assert!(*stride >= 2 * k2);
                                let x = rows_of(x, *stride, t0, t, 2 * k2);
                                kernel_bf16_pairs(isa, w, k2, x, *stride, t, y, ld);
                            }
                        }
                    }
                    (_, Input::Bf16 { .. }) => panic!("bf16 input for non-bf16 weights"),
                }
            }
        }
    }

    /// Group `g` as a row-major `[k, 48]` f32 matrix (`B` of `x · B` for gemm): the packed
    /// data itself for f32, widened into `buf` otherwise.
    pub fn group_f32<'a>(&'a self, g: usize, buf: &'a mut Vec<f32>) -> &'a [f32] {
        let k = self.k;
        match &self.data {
            Packed::F32(w) => &w[g * k * WIDTH..(g + 1) * k * WIDTH],
            Packed::F16(w) => {
                buf.clear();
                buf.extend(
                    w[g * k * WIDTH..(g + 1) * k * WIDTH]
                        .iter()
                        .map(|v| v.to_f32()),
                );
                buf
            }
            Packed::Bf16(w) => {
                let k2 = k.div_ceil(2);
                buf.clear();
                buf.resize(2 * k2 * WIDTH, 0.0);
                let w = &w[g * k2 * WIDTH * 2..(g + 1) * k2 * WIDTH * 2];
                for (p, pairs) in w.chunks_exact(WIDTH * 2).enumerate() {
                    let (even, odd) = buf[2 * p * WIDTH..(2 * p + 2) * WIDTH].split_at_mut(WIDTH);
                    for (l, pair) in pairs.chunks_exact(2).enumerate() {
                        even[l] = bf16_to_f32(pair[0]);
                        odd[l] = bf16_to_f32(pair[1]);
                    }
                }
                &buf[..k * WIDTH]
            }
        }
    }
}

/// `[groups][k][48]` from the rows of row-major `[_, k]` that `order` names.
fn by_input<T: Copy>(v: &[T], k: usize, order: &[Option<usize>], groups: usize, zero: T) -> Vec<T> {
    let mut p = vec![zero; groups * k * WIDTH];
    for (r, src) in order.iter().enumerate() {
        let Some(src) = src else { continue };
        let (g, l) = (r / WIDTH, r % WIDTH);
        for (c, x) in v[src * k..(src + 1) * k].iter().enumerate() {
            p[(g * k + c) * WIDTH + l] = *x;
        }
    }
    p
}

/// Rows `t0..t0 + t` of `x` (`stride` apart), each read up to `len`.
fn rows_of<T>(x: &[T], stride: usize, t0: usize, t: usize, len: usize) -> &[T] {
    &x[t0 * stride..(t0 + t - 1) * stride + len]
}

/// `x` rounded to bf16 (to nearest, ties to even): `vcvtneps2bf16` sixteen at a time on
/// AVX512-BF16 (the input of every bf16 product goes through here, once per step).
fn to_bf16(isa: Isa, x: &[f32], out: &mut [bf16]) {
    assert_eq!(x.len(), out.len(), "to_bf16 lengths");
    #[cfg(target_arch = "x86_64")]
    if isa.0 == Level::Avx512Bf16 {
        let (xs, xt) = x.split_at(x.len() / LANES * LANES);
        let (os, ot) = out.split_at_mut(xs.len());
        for (x, o) in xs.chunks_exact(LANES).zip(os.chunks_exact_mut(LANES)) {
            // SAFETY: the CPU has AVX-512F and AVX512-BF16 (only `Isa::detect` names that
            // level); sixteen f32 are read from `x` and sixteen bf16 written to `o`, both
            // chunks of exactly that length.
            unsafe { x86::bf16_sixteen(x.as_ptr(), o.as_mut_ptr()) };
        }
        ot.iter_mut()
            .zip(xt)
            .for_each(|(o, v)| *o = bf16::from_f32(*v));
        return;
    }
    let _ = isa;
    out.iter_mut()
        .zip(x)
        .for_each(|(o, v)| *o = bf16::from_f32(*v));
}

/// bf16 is the top half of an f32: a shift.
#[inline(always)]
fn bf16_to_f32(x: bf16) -> f32 {
    f32::from_bits(u32::from(x.to_bits()) << 16)
}

/// A safe entry to the `$kernel` blocks (AVX-512 or portable): `t ≤ 8` rows of `x` times
/// one group. `w` is the group (`steps` steps of 48 values, or of 48 pairs with `$per = 2`),
/// `x` the rows (`xs` apart, each at least `$per · steps` long), `y` receives row `i`'s 48
/// outputs at `i * ys`.
macro_rules! block_kernel {
    ($name:ident, $t:ty, $per:expr, $kernel:ident) => {
        #[allow(clippy::too_many_arguments)]
        fn $name(
            isa: Isa,
            w: &[$t],
            steps: usize,
            x: &[f32],
            xs: usize,
            t: usize,
            y: &mut [f32],
            ys: usize,
        ) {
            let len = $per * steps;
            check(w.len(), len * WIDTH, x.len(), xs, t, len, y.len(), ys);
            #[cfg(target_arch = "x86_64")]
            if isa.0 != Level::Portable {
                let (w, x, y) = (w.as_ptr(), x.as_ptr(), y.as_mut_ptr());
                // SAFETY: the CPU has AVX-512F (only `Isa::detect` names a level above
                // `Portable`); `check` keeps every access inside the slices.
                unsafe { by_rows!(t, x86::$kernel, w, steps, x, xs, y, ys) };
                return;
            }
            let _ = isa;
            by_rows!(t, portable::$kernel, w, steps, x, xs, y, ys);
        }
    };
}

block_kernel!(kernel_f32, f32, 1, f32_block);
block_kernel!(kernel_f16, f16, 1, f16_block);
// bf16 weights against f32 input: steps are input pairs.
block_kernel!(kernel_bf16, bf16, 2, bf16_block);

/// bf16 weights against bf16 input on AVX512-BF16.
#[allow(clippy::too_many_arguments)]
fn kernel_bf16_pairs(
    isa: Isa,
    w: &[bf16],
    k2: usize,
    x: &[bf16],
    xs: usize,
    t: usize,
    y: &mut [f32],
    ys: usize,
) {
    check(w.len(), 2 * k2 * WIDTH, x.len(), xs, t, 2 * k2, y.len(), ys);
    #[cfg(target_arch = "x86_64")]
    {
        assert!(isa.0 == Level::Avx512Bf16, "bf16 pairs without AVX512-BF16");
        // SAFETY: the CPU has AVX-512F and AVX512-BF16 (only `Isa::detect` names that level,
        // asserted above); `check` keeps every access inside the slices.
        unsafe {
            by_rows!(
                t,
                x86::bf16_pairs_block,
                w.as_ptr(),
                k2,
                x.as_ptr(),
                xs,
                y.as_mut_ptr(),
                ys
            )
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    panic!("bf16 pair kernels need AVX512-BF16");
}

/// The bounds every kernel relies on: the group holds `need` elements, `t` rows of `len`
/// (`xs` apart) lie inside `x`, and `t` rows of 48 outputs (`ys` apart) inside `y`.
#[allow(clippy::too_many_arguments)]
fn check(w: usize, need: usize, x: usize, xs: usize, t: usize, len: usize, y: usize, ys: usize) {
    assert!((1..=ROWS).contains(&t), "kernel rows {t}");
    assert!(w >= need, "kernel weights");
    assert!(xs >= len && x >= (t - 1) * xs + len, "kernel input");
    assert!(ys >= WIDTH && y >= (t - 1) * ys + WIDTH, "kernel output");
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! The AVX-512 kernels. Callers guarantee the CPU features and that `w` holds the group
    //! (`k` steps of 48 values, or `k2` steps of 48 pairs), that the `T` rows of `x` (`xs`
    //! apart) hold `k` values (`2 · k2`), and that `y` holds `T` rows of 48 (`ys` apart).

    use std::arch::x86_64::*;

    use half::{bf16, f16};

    use super::WIDTH;

    /// Sixteen f32 at `x` rounded to sixteen bf16 at `out`.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn bf16_sixteen(x: *const f32, out: *mut bf16) {
        // SAFETY: the caller keeps sixteen values readable at `x` and writable at `out`;
        // __m256bh and __m256i are both 256 bits of plain data.
        unsafe {
            let v = _mm512_cvtneps_pbh(_mm512_loadu_ps(x));
            _mm256_storeu_si256(out.cast(), std::mem::transmute::<__m256bh, __m256i>(v));
        }
    }

    /// Store the accumulators: row `i`'s three registers at `y + i * ys`.
    #[inline(always)]
    unsafe fn store<const T: usize>(acc: &[[__m512; 3]; T], y: *mut f32, ys: usize) {
        for (i, a) in acc.iter().enumerate() {
            for (j, v) in a.iter().enumerate() {
                // SAFETY: the caller keeps `T` rows of 48 outputs inside `y`.
                unsafe { _mm512_storeu_ps(y.add(i * ys + 16 * j), *v) };
            }
        }
    }

    /// `acc[i][j] += w[j] · x[i · xs]` for each row `i`: one broadcast per row, three
    /// fused multiply-adds.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn madd<const T: usize>(
        acc: &mut [[__m512; 3]; T],
        w: [__m512; 3],
        x: *const f32,
        xs: usize,
    ) {
        for (i, a) in acc.iter_mut().enumerate() {
            // SAFETY: the caller keeps `T` rows of `x` (`xs` apart) readable.
            let xv = _mm512_set1_ps(unsafe { *x.add(i * xs) });
            for j in 0..3 {
                a[j] = _mm512_fmadd_ps(w[j], xv, a[j]);
            }
        }
    }

    /// A block over `[k][48]` weights of type `$t`, each step's three vectors read by
    /// `$load(p)` from the step's first weight `p`.
    macro_rules! block {
        ($name:ident, $t:ty, $load:expr) => {
            #[target_feature(enable = "avx512f")]
            pub(super) unsafe fn $name<const T: usize>(
                w: *const $t,
                k: usize,
                x: *const f32,
                xs: usize,
                y: *mut f32,
                ys: usize,
            ) {
                let mut acc = [[_mm512_setzero_ps(); 3]; T];
                for c in 0..k {
                    // SAFETY: c < k, inside the group and every row (see the module note).
                    unsafe { madd(&mut acc, ($load)(w.add(c * WIDTH)), x.add(c), xs) };
                }
                // SAFETY: see the module note.
                unsafe { store(&acc, y, ys) }
            }
        };
    }

    block!(f32_block, f32, |p: *const f32| [0, 16, 32]
        .map(|o| _mm512_loadu_ps(p.add(o))));
    // f16 widened by `vcvtph2ps`.
    block!(f16_block, f16, |p: *const f16| [0, 16, 32]
        .map(|o| _mm512_cvtph_ps(_mm256_loadu_si256(p.add(o).cast()))));

    /// bf16 weights widened in registers: a pair's first value is the low half of each
    /// 32-bit lane (shifted up), the second the high half (masked).
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn bf16_block<const T: usize>(
        w: *const bf16,
        k2: usize,
        x: *const f32,
        xs: usize,
        y: *mut f32,
        ys: usize,
    ) {
        let mut acc = [[_mm512_setzero_ps(); 3]; T];
        let high = _mm512_set1_epi32(0xffff_0000_u32 as i32);
        for p in 0..k2 {
            // SAFETY: p < k2, inside the group and every row (see the module note).
            unsafe {
                let q = w.add(p * WIDTH * 2);
                let raw = [
                    _mm512_loadu_si512(q.cast()),
                    _mm512_loadu_si512(q.add(32).cast()),
                    _mm512_loadu_si512(q.add(64).cast()),
                ];
                let even = raw.map(|r| _mm512_castsi512_ps(_mm512_slli_epi32::<16>(r)));
                madd(&mut acc, even, x.add(2 * p), xs);
                let odd = raw.map(|r| _mm512_castsi512_ps(_mm512_and_si512(r, high)));
                madd(&mut acc, odd, x.add(2 * p + 1), xs);
            }
        }
        // SAFETY: see the module note.
        unsafe { store(&acc, y, ys) }
    }

    /// bf16 weights and input: `vdpbf16ps` multiplies each lane's pair by the row's pair
    /// (one 32-bit broadcast) and adds both products.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn bf16_pairs_block<const T: usize>(
        w: *const bf16,
        k2: usize,
        x: *const bf16,
        xs: usize,
        y: *mut f32,
        ys: usize,
    ) {
        let mut acc = [[_mm512_setzero_ps(); 3]; T];
        for p in 0..k2 {
            // SAFETY: p < k2, inside the group and every row (see the module note); __m512i
            // and __m512bh are both 512 bits of plain data.
            unsafe {
                let q = w.add(p * WIDTH * 2);
                let load = |o: usize| {
                    std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(q.add(o).cast()))
                };
                let wv = [load(0), load(32), load(64)];
                for (i, a) in acc.iter_mut().enumerate() {
                    let pair = x.add(i * xs + 2 * p).cast::<i32>().read_unaligned();
                    let xv = std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(pair));
                    for j in 0..3 {
                        a[j] = _mm512_dpbf16_ps(a[j], wv[j], xv);
                    }
                }
            }
        }
        // SAFETY: see the module note.
        unsafe { store(&acc, y, ys) }
    }
}

mod portable {
    //! The same blocks in plain Rust for CPUs without AVX-512, compiled for AVX2 and NEON
    //! as well and chosen at run time.

    use half::{bf16, f16};

    use super::{WIDTH, bf16_to_f32};

    macro_rules! block {
        ($name:ident, $t:ty, $widen:expr) => {
            #[multiversion::multiversion(targets("x86_64+avx2+fma", "aarch64+neon"))]
            pub(super) fn $name<const T: usize>(
                w: &[$t],
                k: usize,
                x: &[f32],
                xs: usize,
                y: &mut [f32],
                ys: usize,
            ) {
                let mut acc = [[0.0f32; WIDTH]; T];
                for (c, wc) in w.chunks_exact(WIDTH).take(k).enumerate() {
                    let wv: [f32; WIDTH] = std::array::from_fn(|l| ($widen)(wc[l]));
                    for (i, a) in acc.iter_mut().enumerate() {
                        let xv = x[i * xs + c];
                        for (a, w) in a.iter_mut().zip(&wv) {
                            *a += w * xv;
                        }
                    }
                }
                for (i, a) in acc.iter().enumerate() {
                    y[i * ys..i * ys + WIDTH].copy_from_slice(a);
                }
            }
        };
    }

    block!(f32_block, f32, |v: f32| v);
    block!(f16_block, f16, f16::to_f32);

    #[multiversion::multiversion(targets("x86_64+avx2+fma", "aarch64+neon"))]
    pub(super) fn bf16_block<const T: usize>(
        w: &[bf16],
        k2: usize,
        x: &[f32],
        xs: usize,
        y: &mut [f32],
        ys: usize,
    ) {
        let mut acc = [[0.0f32; WIDTH]; T];
        for (p, wp) in w.chunks_exact(2 * WIDTH).take(k2).enumerate() {
            let even: [f32; WIDTH] = std::array::from_fn(|l| bf16_to_f32(wp[2 * l]));
            let odd: [f32; WIDTH] = std::array::from_fn(|l| bf16_to_f32(wp[2 * l + 1]));
            for (i, a) in acc.iter_mut().enumerate() {
                let (x0, x1) = (x[i * xs + 2 * p], x[i * xs + 2 * p + 1]);
                for l in 0..WIDTH {
                    a[l] += even[l] * x0 + odd[l] * x1;
                }
            }
        }
        for (i, a) in acc.iter().enumerate() {
            y[i * ys..i * ys + WIDTH].copy_from_slice(a);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vector rounding agrees with `half`'s on ties, signs, extremes, subnormals and the
    /// tail past the last sixteen.
    #[test]
    fn bf16_rounding_matches_half() {
        let mut x: Vec<f32> = (0..1000)
            .map(|i| f32::from_bits(0x3f80_0000 + i * 0x4001) * if i % 3 == 0 { -1.0 } else { 1.0 })
            .collect();
        // Exact ties (low half 0x8000) both ways, extremes, a subnormal, zero and infinity.
        x.extend([
            f32::from_bits(0x3f80_8000),
            f32::from_bits(0x3f81_8000),
            f32::MAX,
            f32::MIN_POSITIVE,
            1e-40,
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ]);
        for isa in [Isa::detect(), Isa::portable()] {
            let mut got = vec![bf16::ZERO; x.len()];
            to_bf16(isa, &x, &mut got);
            for (g, v) in got.iter().zip(&x) {
                let want = bf16::from_f32(*v);
                // vcvtneps2bf16 may flush subnormal inputs to zero (of the same sign).
                let flushed =
                    v.is_subnormal() && g.to_bits() == bf16::from_f32(0.0 * v.signum()).to_bits();
                assert!(
                    g.to_bits() == want.to_bits() || flushed,
                    "{isa:?} {v:e}: {g} vs {want}"
                );
            }
        }
        let mut nan = [bf16::ZERO];
        to_bf16(Isa::detect(), &[f32::NAN], &mut nan);
        assert!(nan[0].is_nan());
    }

    /// Every kernel this CPU has (and the portable ones) against the definition, for shapes
    /// that leave partial groups, odd inputs and partial row blocks.
    #[test]
    fn every_kernel_matches_the_definition() {
        let best = Isa::detect();
        let mut isas = vec![Isa::portable()];
        if best.without_bf16() != Isa::portable() {
            isas.push(best.without_bf16());
        }
        if best.0 == Level::Avx512Bf16 {
            isas.push(best);
        } else {
            println!("SKIPPED AVX512-BF16 kernels: not on this CPU");
        }
        for (rows, k) in [(48, 64), (50, 33), (7, 96), (130, 17)] {
            let w: Vec<f32> = (0..rows * k)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 64.0)
                .collect();
            for m in [1, 2, 7, 8, 9, 16, 21] {
                let x: Vec<f32> = (0..m * k)
                    .map(|i| ((i * 13 % 29) as f32 - 14.0) / 16.0)
                    .collect();
                for data in [
                    Host::F32(w.clone()),
                    Host::F16(w.iter().map(|v| f16::from_f32(*v)).collect()),
                    Host::Bf16(w.iter().map(|v| bf16::from_f32(*v)).collect()),
                ] {
                    let dt = data.dtype();
                    let p = Panels::pack(&data, rows, k);
                    for &isa in &isas {
                        if isa.0 == Level::Avx512Bf16 && !matches!(data, Host::Bf16(_)) {
                            continue;
                        }
                        let mut buf = InputBuf::default();
                        let input = p.input(&x, m, isa, &mut buf);
                        let ld = p.groups() * WIDTH + 5;
                        let mut out = vec![f32::NAN; m * ld];
                        p.product(0..p.groups(), &input, m, isa, &mut out, ld);
                        for t in 0..m {
                            for r in 0..p.groups() * WIDTH {
                                let want: f32 = if r < rows {
                                    (0..k).map(|c| x[t * k + c] * w[r * k + c]).sum()
                                } else {
                                    0.0
                                };
                                let got = out[t * ld + r];
                                // Inputs rounded to bf16 (multiples of 1/16 below 1 are exact).
                                assert!(
                                    (got - want).abs() < 1e-3,
                                    "{dt:?} {isa:?} {rows}×{k} m={m} ({t}, {r}): {got} vs {want}"
                                );
                            }
                        }
                        let mut wide = Vec::new();
                        for g in 0..p.groups() {
                            let b = p.group_f32(g, &mut wide);
                            assert_eq!(b.len(), k * WIDTH);
                            for c in 0..k {
                                for l in 0..WIDTH {
                                    let r = g * WIDTH + l;
                                    let want = if r < rows { w[r * k + c] } else { 0.0 };
                                    assert_eq!(b[c * WIDTH + l], want, "{dt:?} group {g}");
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}
