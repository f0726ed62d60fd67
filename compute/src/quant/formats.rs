//! The block layouts of ggml's quantized types (`ggml-common.h`), each described by how one
//! chunk of 32 values unpacks: `w = s·u + o` per half of 16, `u` unsigned (Q8_0: `w = s·u`
//! with `u` signed).

use half::f16;

use super::CHUNK;

/// The quantized types this engine multiplies without widening: `dyn-model`'s, which sizes a
/// GGUF tensor's bytes by them (the tests check those sizes against the layouts here).
pub use dyn_model::gguf::QType;

/// A chunk's scales and offsets, per half of 16 values.
#[derive(Debug, Clone, Copy)]
pub struct Chunk {
    pub s: [f32; 2],
    pub o: [f32; 2],
}

/// One block layout.
pub trait Format {
    /// Values per block.
    const BLOCK: usize;
    /// Bytes per block.
    const BYTES: usize;
    /// `u` holds signed values and there is no offset (Q8_0).
    const SIGNED: bool = false;

    /// Chunk `c` (of `BLOCK / 32`) of `block`: its 32 values into `u`, its scales and offsets
    /// returned.
    fn unpack(block: &[u8], c: usize, u: &mut [u8; CHUNK]) -> Chunk;
}

pub(super) fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Nibbles of 16 bytes: low ones are values 0..16, high ones 16..32.
fn nibbles(q: &[u8], u: &mut [u8; CHUNK]) {
    let (lo, hi) = u.split_at_mut(16);
    for ((l, h), q) in lo.iter_mut().zip(hi).zip(q) {
        *l = q & 15;
        *h = q >> 4;
    }
}

/// `{f16 d; u8 qs[16]}`: `w = d · (q - 8)`.
pub struct Q4_0;
impl Format for Q4_0 {
    const BLOCK: usize = 32;
    const BYTES: usize = 18;
    fn unpack(b: &[u8], _: usize, u: &mut [u8; CHUNK]) -> Chunk {
        let d = f16_at(b, 0);
        nibbles(&b[2..18], u);
        Chunk {
            s: [d; 2],
            o: [-8.0 * d; 2],
        }
    }
}

/// `{f16 d; f16 m; u8 qs[16]}`: `w = d · q + m`.
pub struct Q4_1;
impl Format for Q4_1 {
    const BLOCK: usize = 32;
    const BYTES: usize = 20;
    fn unpack(b: &[u8], _: usize, u: &mut [u8; CHUNK]) -> Chunk {
        let (d, m) = (f16_at(b, 0), f16_at(b, 2));
        nibbles(&b[4..20], u);
        Chunk {
            s: [d; 2],
            o: [m; 2],
        }
    }
}

/// `{f16 d; i8 qs[32]}`: `w = d · q`.
pub struct Q8_0;
impl Format for Q8_0 {
    const BLOCK: usize = 32;
    const BYTES: usize = 34;
    const SIGNED: bool = true;
    fn unpack(b: &[u8], _: usize, u: &mut [u8; CHUNK]) -> Chunk {
        u.copy_from_slice(&b[2..34]);
        Chunk {
            s: [f16_at(b, 0); 2],
            o: [0.0; 2],
        }
    }
}

/// The 6-bit scale and min of sub-block `j` (of 8) in a K-quant's 12 scale bytes
/// (`get_scale_min_k4`).
pub(super) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Q4_K and Q5_K's scale and offset for sub-block (chunk) `c`.
fn k4_chunk(b: &[u8], c: usize) -> Chunk {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (sc, m) = scale_min_k4(c, &b[4..16]);
    Chunk {
        s: [d * f32::from(sc); 2],
        o: [-dmin * f32::from(m); 2],
    }
}

/// `{f16 d; f16 dmin; u8 scales[12]; u8 qs[128]}`: eight sub-blocks of 32, each
/// `w = d·sc·q - dmin·m`; sub-blocks 2p and 2p+1 are the low and high nibbles of
/// `qs[32p..32p+32]`.
pub struct Q4K;
impl Format for Q4K {
    const BLOCK: usize = 256;
    const BYTES: usize = 144;
    fn unpack(b: &[u8], c: usize, u: &mut [u8; CHUNK]) -> Chunk {
        let q = &b[16 + 32 * (c / 2)..16 + 32 * (c / 2 + 1)];
        let shift = 4 * (c % 2);
        for (u, q) in u.iter_mut().zip(q) {
            *u = (q >> shift) & 15;
        }
        k4_chunk(b, c)
    }
}

/// `{f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]}`: Q4_K's layout with a fifth
/// bit per value, bit `c` of `qh[l]` for value `l` of sub-block `c`.
pub struct Q5K;
impl Format for Q5K {
    const BLOCK: usize = 256;
    const BYTES: usize = 176;
    fn unpack(b: &[u8], c: usize, u: &mut [u8; CHUNK]) -> Chunk {
        let qh = &b[16..48];
        let q = &b[48 + 32 * (c / 2)..48 + 32 * (c / 2 + 1)];
        let shift = 4 * (c % 2);
        for ((u, q), h) in u.iter_mut().zip(q).zip(qh) {
            *u = ((q >> shift) & 15) | (((h >> c) & 1) << 4);
        }
        k4_chunk(b, c)
    }
}

/// `{u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d}`: sixteen sub-blocks of 16, each
/// `w = d·sc·(q - 32)` with 6-bit `q`. Each half of 128 values takes 64 bytes of `ql`
/// (low nibbles, then high) and 32 of `qh` (two bits per value, four values per byte).
pub struct Q6K;
impl Format for Q6K {
    const BLOCK: usize = 256;
    const BYTES: usize = 210;
    fn unpack(b: &[u8], c: usize, u: &mut [u8; CHUNK]) -> Chunk {
        let (n, part) = (c / 4, c % 4);
        let ql = &b[64 * n + 32 * (part % 2)..][..32];
        let qh = &b[128 + 32 * n..][..32];
        let (lshift, hshift) = (4 * (part / 2), 2 * part);
        for ((u, l), h) in u.iter_mut().zip(ql).zip(qh) {
            *u = ((l >> lshift) & 15) | (((h >> hshift) & 3) << 4);
        }
        let d = f16_at(b, 208);
        let sc = |h: usize| d * f32::from(b[192 + 8 * n + h + 2 * part] as i8);
        let s = [sc(0), sc(1)];
        Chunk {
            s,
            o: [-32.0 * s[0], -32.0 * s[1]],
        }
    }
}
