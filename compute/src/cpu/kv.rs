//! The CPU backend's paged KV cache, kept in the model's precision.
//!
//! A decode step reads every cached key and value of every sequence once per layer, and at
//! sixteen sequences that is the largest memory traffic after the weights. The cache
//! therefore holds the weights' element type (f32, bf16 or f16) — what transformers and the
//! CUDA backend keep too — and attention widens sixteen values per load. Per layer, keys are
//! `[block][kv_head][dim][slot]` (transposed: a decode query scores a block's sixteen slots
//! with one vector per dimension) and values `[block][kv_head][slot][dim]`; exported blocks
//! are in [`Elem`]'s type, little-endian, in the layout every backend exchanges
//! ([`crate::transfer::BlockLayout::LayerKvHeadSlotDim`]).

#![allow(unsafe_code)]

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use half::{bf16, f16};

use crate::backend::SeqStep;
use crate::model::DType;

/// A cache element: f32 or a half type, widened to f32 for arithmetic.
pub trait Elem: Copy + Send + Sync + 'static {
    const DTYPE: DType;
    const ZERO: Self;
    fn from_f32(x: f32) -> Self;
    fn to_f32(self) -> f32;
    /// Into `size_of::<Self>()` (= `DTYPE.size()`) little-endian bytes.
    fn write_le(self, out: &mut [u8]);
    /// From `size_of::<Self>()` little-endian bytes.
    fn from_le(b: &[u8]) -> Self;
    /// Sixteen elements at `p` widened into one vector.
    ///
    /// # Safety
    /// The CPU has AVX-512F and sixteen elements are readable at `p`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> __m512;
}

macro_rules! elem {
    ($t:ty, $dtype:expr, $zero:expr, $from:expr, $to:expr, $load:expr) => {
        impl Elem for $t {
            const DTYPE: DType = $dtype;
            const ZERO: Self = $zero;
            #[inline(always)]
            fn from_f32(x: f32) -> Self {
                ($from)(x)
            }
            #[inline(always)]
            fn to_f32(self) -> f32 {
                ($to)(self)
            }
            #[inline(always)]
            fn write_le(self, out: &mut [u8]) {
                out.copy_from_slice(&self.to_le_bytes());
            }
            #[inline(always)]
            fn from_le(b: &[u8]) -> Self {
                let mut a = [0; std::mem::size_of::<$t>()];
                a.copy_from_slice(b);
                <$t>::from_le_bytes(a)
            }
            #[cfg(target_arch = "x86_64")]
            #[inline(always)]
            unsafe fn load16(p: *const Self) -> __m512 {
                // SAFETY: the caller guarantees AVX-512F and sixteen readable elements.
                unsafe { ($load)(p) }
            }
        }
    };
}

elem!(f32, DType::F32, 0.0, |x| x, |x| x, |p: *const f32| {
    _mm512_loadu_ps(p)
});
// bf16 is the top half of an f32: widen the sixteen 16-bit values to 32 and shift.
elem!(
    bf16,
    DType::Bf16,
    bf16::ZERO,
    bf16::from_f32,
    bf16::to_f32,
    |p: *const bf16| _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
        _mm256_loadu_si256(p.cast())
    )))
);
elem!(
    f16,
    DType::F16,
    f16::ZERO,
    f16::from_f32,
    f16::to_f32,
    |p: *const f16| _mm512_cvtph_ps(_mm256_loadu_si256(p.cast()))
);

/// Keys and values of every layer, `per_layer` elements each.
pub struct Cache<T> {
    pub k: Vec<Vec<T>>,
    pub v: Vec<Vec<T>>,
}

/// The cache in the model's element type.
pub enum KvCache {
    F32(Cache<f32>),
    Bf16(Cache<bf16>),
    F16(Cache<f16>),
}

/// Run `$body` with `$c` bound to the cache, whatever its element type.
macro_rules! on_cache {
    ($cache:expr, $c:ident => $body:expr) => {
        match $cache {
            KvCache::F32($c) => $body,
            KvCache::Bf16($c) => $body,
            KvCache::F16($c) => $body,
        }
    };
}
pub(super) use on_cache;

impl KvCache {
    pub fn new(dtype: DType, layers: usize, per_layer: usize) -> KvCache {
        fn cache<T: Elem>(layers: usize, per_layer: usize) -> Cache<T> {
            Cache {
                k: vec![vec![T::ZERO; per_layer]; layers],
                v: vec![vec![T::ZERO; per_layer]; layers],
            }
        }
        match dtype {
            DType::F32 => KvCache::F32(cache(layers, per_layer)),
            DType::Bf16 => KvCache::Bf16(cache(layers, per_layer)),
            DType::F16 => KvCache::F16(cache(layers, per_layer)),
        }
    }
}

/// Where a block's parts lie: `bs` slots of `d` dimensions for each of `kv_heads` heads.
#[derive(Clone, Copy)]
pub struct Geometry {
    pub bs: usize,
    pub d: usize,
    pub kv_heads: usize,
}

impl Geometry {
    pub fn block_elems(self) -> usize {
        self.kv_heads * self.bs * self.d
    }
}

impl<T: Elem> Cache<T> {
    /// Store layer `li`'s new keys and values: row `i` of `qkv` (`width` apart, keys at
    /// `kd`, values at `vd`, each `kv_heads · d`) is token `owner[i] = (sequence, position)`.
    #[allow(clippy::too_many_arguments)]
    pub fn store(
        &mut self,
        li: usize,
        geo: Geometry,
        batch: &[SeqStep<'_>],
        owner: &[(usize, usize)],
        qkv: &[f32],
        width: usize,
        kd: usize,
        vd: usize,
    ) {
        let Geometry { bs, d, kv_heads } = geo;
        let (kc, vc) = (&mut self.k[li], &mut self.v[li]);
        for (row, &(si, pos)) in qkv.chunks_exact(width).zip(owner) {
            let blk = batch[si].blocks[pos / bs] as usize;
            for g in 0..kv_heads {
                let head = blk * geo.block_elems() + g * bs * d;
                let key = &row[kd + g * d..kd + (g + 1) * d];
                for (j, x) in key.iter().enumerate() {
                    kc[head + j * bs + pos % bs] = T::from_f32(*x);
                }
                let at = head + pos % bs * d;
                let value = &row[vd + g * d..vd + (g + 1) * d];
                for (o, x) in vc[at..at + d].iter_mut().zip(value) {
                    *o = T::from_f32(*x);
                }
            }
        }
    }

    /// Block `block` as the cache holds it (per layer its keys, then its values: no
    /// reordering, so a memcpy each), for this backend's own offload tiers.
    pub fn save(&self, block: usize, geo: Geometry) -> Vec<u8> {
        let n = geo.block_elems();
        let at = block * n;
        let mut out = Vec::with_capacity(self.k.len() * 2 * n * std::mem::size_of::<T>());
        for (k, v) in self.k.iter().zip(&self.v) {
            put_raw(&k[at..at + n], &mut out);
            put_raw(&v[at..at + n], &mut out);
        }
        out
    }

    /// Block `block` from [`Cache::save`]'s bytes.
    pub fn load(&mut self, block: usize, geo: Geometry, bytes: &[u8]) {
        let n = geo.block_elems();
        let at = block * n;
        let half = n * std::mem::size_of::<T>();
        for ((k, v), layer) in self
            .k
            .iter_mut()
            .zip(&mut self.v)
            .zip(bytes.chunks_exact(2 * half))
        {
            let (keys, values) = layer.split_at(half);
            get_raw(keys, &mut k[at..at + n]);
            get_raw(values, &mut v[at..at + n]);
        }
    }

    /// Block `block` in the exchanged layout. Written element by element straight into the
    /// output (keys transposed on the way), with no intermediate copy: disaggregation moves
    /// every prefilled block through here (offload tiers use [`Cache::save`]).
    pub fn export(&self, block: usize, geo: Geometry) -> Vec<u8> {
        let (n, size) = (geo.block_elems(), std::mem::size_of::<T>());
        let mut out = vec![0u8; self.k.len() * 2 * n * size];
        self.export_into(block, geo, &mut out);
        out
    }

    /// [`Cache::export`] into `out`, which has exactly a block's bytes.
    pub fn export_into(&self, block: usize, geo: Geometry, out: &mut [u8]) {
        let (n, size) = (geo.block_elems(), std::mem::size_of::<T>());
        let at = block * n;
        for ((k, v), layer) in self
            .k
            .iter()
            .zip(&self.v)
            .zip(out.chunks_exact_mut(2 * n * size))
        {
            let (keys, values) = layer.split_at_mut(n * size);
            // The cache's keys are `[dim][slot]` per head; the exchanged ones `[slot][dim]`.
            for (head, dst) in k[at..at + n]
                .chunks_exact(geo.bs * geo.d)
                .zip(keys.chunks_exact_mut(geo.bs * geo.d * size))
            {
                for (j, col) in head.chunks_exact(geo.bs).enumerate() {
                    for (i, x) in col.iter().enumerate() {
                        let o = (i * geo.d + j) * size;
                        x.write_le(&mut dst[o..o + size]);
                    }
                }
            }
            for (x, o) in v[at..at + n].iter().zip(values.chunks_exact_mut(size)) {
                x.write_le(o);
            }
        }
    }

    /// Block `block` from the exchanged layout (`bytes` is a whole block: the backend
    /// checks its length against `Backend::block_bytes` first), read straight into the
    /// cache: a decode worker's imports move every block through here.
    pub fn import(&mut self, block: usize, geo: Geometry, bytes: &[u8]) {
        let (n, size) = (geo.block_elems(), std::mem::size_of::<T>());
        let at = block * n;
        for ((k, v), layer) in self
            .k
            .iter_mut()
            .zip(&mut self.v)
            .zip(bytes.chunks_exact(2 * n * size))
        {
            let (keys, values) = layer.split_at(n * size);
            for (head, src) in k[at..at + n]
                .chunks_exact_mut(geo.bs * geo.d)
                .zip(keys.chunks_exact(geo.bs * geo.d * size))
            {
                // Each cache row (one dimension, every slot) gathers a column of the source.
                for (j, row) in head.chunks_exact_mut(geo.bs).enumerate() {
                    for (i, x) in row.iter_mut().enumerate() {
                        let o = (i * geo.d + j) * size;
                        *x = T::from_le(&src[o..o + size]);
                    }
                }
            }
            for (x, b) in v[at..at + n].iter_mut().zip(values.chunks_exact(size)) {
                *x = T::from_le(b);
            }
        }
    }
}

/// Append `src` as little-endian bytes.
fn put_raw<T: Elem>(src: &[T], out: &mut Vec<u8>) {
    debug_assert_eq!(T::DTYPE.size(), std::mem::size_of::<T>());
    #[cfg(target_endian = "little")]
    {
        // SAFETY: `Elem` is implemented for f32, bf16 and f16 only (above): plain values
        // without padding, whose in-memory bytes on a little-endian target are their
        // little-endian encoding; the slice is `size_of_val(src)` initialised bytes.
        let bytes = unsafe {
            std::slice::from_raw_parts(src.as_ptr().cast::<u8>(), std::mem::size_of_val(src))
        };
        out.extend_from_slice(bytes);
    }
    #[cfg(not(target_endian = "little"))]
    for x in src {
        let at = out.len();
        out.resize(at + std::mem::size_of::<T>(), 0);
        x.write_le(&mut out[at..]);
    }
}

/// Fill `dst` from little-endian bytes (`bytes.len()` is `size_of_val(dst)`).
fn get_raw<T: Elem>(bytes: &[u8], dst: &mut [T]) {
    #[cfg(target_endian = "little")]
    {
        // SAFETY: as in `put_raw`; every bit pattern is a valid f32, bf16 or f16, and the
        // destination is `size_of_val(dst)` writable bytes.
        let raw = unsafe {
            std::slice::from_raw_parts_mut(
                dst.as_mut_ptr().cast::<u8>(),
                std::mem::size_of_val(dst),
            )
        };
        raw.copy_from_slice(bytes);
    }
    #[cfg(not(target_endian = "little"))]
    for (x, b) in dst
        .iter_mut()
        .zip(bytes.chunks_exact(std::mem::size_of::<T>()))
    {
        *x = T::from_le(b);
    }
}
