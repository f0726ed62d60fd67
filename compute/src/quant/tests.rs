use proptest::prelude::*;

use super::*;

/// Every quantized type.
pub(crate) const TYPES: [QType; 6] = [
    QType::Q4_0,
    QType::Q4_1,
    QType::Q8_0,
    QType::Q4K,
    QType::Q5K,
    QType::Q6K,
];

/// Offsets of a block's f16 scale fields (random bytes there could be inf or NaN).
fn scale_fields(ty: QType) -> &'static [usize] {
    match ty {
        QType::Q4_0 | QType::Q8_0 => &[0],
        QType::Q4_1 | QType::Q4K | QType::Q5K => &[0, 2],
        QType::Q6K => &[208],
    }
}

/// Deterministic random bytes (splitmix64).
fn bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            (z ^ (z >> 31)) as u8
        })
        .collect()
}

/// A random `[rows, cols]` matrix of `ty` with scales in ±[0.002, 0.05).
pub(crate) fn matrix(ty: QType, rows: usize, cols: usize, seed: u64) -> QTensor {
    let n = rows * ty.row_bytes(cols).unwrap();
    let mut data = bytes(seed, n);
    for (i, block) in data.chunks_exact_mut(ty.block_bytes()).enumerate() {
        for (j, &at) in scale_fields(ty).iter().enumerate() {
            let r = bytes(seed ^ (i * 8 + j) as u64, 2);
            let v =
                (0.002 + f32::from(r[0]) / 256.0 * 0.048) * if r[1] & 1 == 0 { 1.0 } else { -1.0 };
            block[at..at + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
        }
    }
    QTensor::new(ty, rows, cols, data).unwrap()
}

fn input(m: usize, k: usize, seed: u64) -> Vec<f32> {
    bytes(seed, m * k)
        .into_iter()
        .map(|b| (f32::from(b) - 127.5) / 64.0)
        .collect()
}

fn isas() -> Vec<Isa> {
    let best = Isa::detect();
    let mut v = vec![best, best.without_vnni(), Isa::portable()];
    v.dedup();
    v
}

/// The activations as the kernels see them (each chunk's q · d).
fn dequantized_acts(a: &Acts) -> Vec<f32> {
    a.q.iter()
        .enumerate()
        .map(|(i, q)| f32::from(*q) * a.d[i / CHUNK])
        .collect()
}

/// `x · Wᵀ`, and `|x| · |W|ᵀ` (what rounding errors scale with).
fn reference(w: &QTensor, x: &[f32], m: usize) -> (Vec<f32>, Vec<f32>) {
    let wf = w.to_f32();
    let k = w.cols;
    let mut y = vec![0.0; m * w.rows];
    let mut mag = vec![0.0; m * w.rows];
    for i in 0..m {
        for r in 0..w.rows {
            let terms = (0..k).map(|c| f64::from(x[i * k + c]) * f64::from(wf[r * k + c]));
            y[i * w.rows + r] = terms.clone().sum::<f64>() as f32;
            mag[i * w.rows + r] = terms.map(f64::abs).sum::<f64>() as f32;
        }
    }
    (y, mag)
}

fn check(w: &QTensor, m: usize, seed: u64, what: &str) {
    let x = input(m, w.cols, seed);
    let mut acts = Acts::default();
    acts.quantize(&x, m, w.cols);
    let (want, mag) = reference(w, &dequantized_acts(&acts), m);
    let (exact, _) = reference(w, &x, m);
    for (isa, panels) in isas().into_iter().flat_map(|i| [(i, false), (i, true)]) {
        let mut y = vec![f32::NAN; m * w.rows];
        if panels {
            // The eight-row panels, where this type and CPU have them (zero rows pad).
            let Some(p) = QPanels::pack(w, isa) else {
                continue;
            };
            let np = w.rows.div_ceil(panel::ROWS);
            let ld = np * panel::ROWS;
            let mut all = vec![f32::NAN; m * ld];
            p.product(0..np, &acts, isa, &mut all, ld);
            for (dst, src) in y.chunks_exact_mut(w.rows).zip(all.chunks_exact(ld)) {
                dst.copy_from_slice(&src[..w.rows]);
            }
        } else {
            w.product(0..w.rows, &acts, &mut y, w.rows);
        }
        for (j, (g, e)) in y.iter().zip(&want).enumerate() {
            assert!(
                (g - e).abs() <= 1e-5 * mag[j].max(1e-3),
                "{what} {} panels={panels} m={m} [{j}]: {g} vs {e}",
                isa.name()
            );
            // Against the unquantized input: 8-bit activations (a step of 1/254 of each
            // chunk's largest value) cost well under 1 % of the terms' size.
            assert!(
                (g - exact[j]).abs() <= 0.01 * mag[j].max(1e-3),
                "{what} {} m={m} [{j}]: {g} vs unquantized {}",
                isa.name(),
                exact[j]
            );
        }
    }
}

#[test]
fn dequantization_matches_ggml() {
    let vectors: serde_json::Value =
        serde_json::from_str(include_str!("../../tests/data/quant_vectors.json")).unwrap();
    for ty in TYPES {
        let v = &vectors[ty.name()];
        let hex = v["bytes"].as_str().unwrap();
        let data: Vec<u8> = (0..hex.len() / 2)
            .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap())
            .collect();
        let want: Vec<f32> = v["values"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect();
        let mut got = vec![0.0; want.len()];
        dequantize(ty, &data, &mut got);
        let scale = want.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        for (i, (g, e)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - e).abs() <= 1e-6 * scale,
                "{} [{i}]: {g} vs {e}",
                ty.name()
            );
        }
    }
}

/// The GGUF reader (`dyn-model`, whose `QType` this is) sizes each type's blocks as the
/// layouts here unpack them: it checks a file's tensor table by those sizes before a matrix
/// is built here.
#[test]
fn block_sizes_agree_with_the_layouts() {
    fn of<F: Format>() -> (usize, usize) {
        (F::BLOCK, F::BYTES)
    }
    for ty in TYPES {
        let layout = match ty {
            QType::Q4_0 => of::<Q4_0>(),
            QType::Q4_1 => of::<Q4_1>(),
            QType::Q8_0 => of::<Q8_0>(),
            QType::Q4K => of::<Q4K>(),
            QType::Q5K => of::<Q5K>(),
            QType::Q6K => of::<Q6K>(),
        };
        assert_eq!((ty.block(), ty.block_bytes()), layout, "{}", ty.name());
    }
}

#[test]
fn products_match_the_dequantized_reference_at_every_batch_size() {
    // The panels exist where this CPU has AVX2 (the checks below then cover them).
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        for ty in TYPES {
            let cols = ty.block().max(64);
            assert!(QPanels::pack(&matrix(ty, 8, cols, 1), Isa::detect()).is_some());
        }
    }
    // Every row count the panel path takes (1..=64), on every kernel this CPU has; five
    // panels (the last padded): two pairs for the 512-bit kernel and one alone.
    for ty in TYPES {
        let cols = 2 * ty.block().max(64);
        let w = matrix(ty, 37, cols, 11);
        for m in 1..=64 {
            check(&w, m, m as u64, ty.name());
        }
    }
}

#[test]
fn activations_quantize_as_llama_cpp_does() {
    let mut x = vec![0.0f32; 64];
    x[3] = -2.54;
    x[5] = 1.0;
    x[40] = 0.5;
    let mut a = Acts::default();
    a.quantize(&x, 1, 64);
    assert_eq!((a.q[3], a.q[5]), (-127, 50));
    assert!((a.d[0] - 0.02).abs() < 1e-7);
    assert_eq!(a.q[40], 127);
    // An all-zero chunk has scale 0 and stays zero.
    let mut z = Acts::default();
    z.quantize(&[0.0; 32], 1, 32);
    assert_eq!((z.d[0], z.q.iter().all(|q| *q == 0)), (0.0, true));
}

/// The vector quantizer and the scalar reference agree exactly, exact halves (ties) and
/// zero chunks included, on runs long enough to go parallel.
#[test]
fn vector_quantizer_matches_the_reference() {
    let mut x = input(40, 1024, 3);
    // Chunk 0's maximum is 127, so its values quantize to themselves: 2.5 and -3.5 are ties.
    x[..32].fill(0.0);
    (x[0], x[1], x[2]) = (127.0, 2.5, -3.5);
    x[32..64].fill(0.0);
    let mut a = Acts::default();
    a.quantize(&x, 40, 1024);
    for (c, x) in x.chunks_exact(CHUNK).enumerate() {
        let (mut q, mut d, mut sums) = ([0i8; CHUNK], 0.0, [0.0; 2]);
        quantize_chunk(x, &mut q, &mut d, &mut sums);
        assert_eq!(&a.q[c * CHUNK..(c + 1) * CHUNK], &q, "chunk {c}");
        assert_eq!((a.d[c], a.sums[c]), (d, sums), "chunk {c}");
    }
    assert_eq!(&a.q[..3], &[127, 2, -4]);
}

#[test]
fn selected_rows_and_zero_rows() {
    let w = matrix(QType::Q4_1, 3, 64, 5);
    let s = w.select_rows(&[Some(2), None, Some(0)]);
    let (a, b) = (w.to_f32(), s.to_f32());
    assert_eq!(&b[..64], &a[128..]);
    assert!(b[64..128].iter().all(|v| *v == 0.0));
    assert_eq!(&b[128..], &a[..64]);
    // Rows of different types stack, each keeping its own.
    let k = matrix(QType::Q6K, 2, 256, 9);
    let wide = matrix(QType::Q4_0, 1, 256, 3);
    let c = QTensor::concat(&[&wide, &k]).unwrap();
    assert_eq!((c.rows, c.types()), (3, vec![QType::Q4_0, QType::Q6K]));
    let mut y = vec![0.0; 3 * 256];
    y[..256].copy_from_slice(&wide.to_f32());
    y[256..].copy_from_slice(&k.to_f32());
    assert_eq!(c.to_f32(), y);
    check(&c, 5, 1, "mixed");
    // Panels of types A, B, B, A: the first and last run alone, the Bs as a pair.
    let a = matrix(QType::Q4_0, 8, 256, 4);
    let b = matrix(QType::Q6K, 16, 256, 5);
    let tail = matrix(QType::Q4_0, 5, 256, 6);
    let c = QTensor::concat(&[&a, &b, &tail]).unwrap();
    for m in [1, 8, 13] {
        check(&c, m, m as u64, "mixed panels");
    }
    assert!(QTensor::concat(&[&w, &k]).is_err());
    assert!(QTensor::new(QType::Q4K, 1, 64, vec![0; 36]).is_err());
    assert!(QTensor::new(QType::Q4_0, 2, 64, vec![0; 36]).is_err());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Any whole number of blocks, any row count, random bytes and scales: every kernel
    /// agrees with the reference (block boundaries inside and between rows).
    #[test]
    fn any_shape_on_every_kernel(t in 0usize..6, blocks in 1usize..5, rows in 1usize..40,
                                 m in 1usize..10, seed in any::<u64>()) {
        let ty = TYPES[t];
        let w = matrix(ty, rows, blocks * ty.block(), seed);
        check(&w, m, seed.rotate_left(7), ty.name());
    }
}
