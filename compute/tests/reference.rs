//! The CPU backend against Hugging Face transformers (reference logits and greedy tokens made
//! by scripts/make-native-fixtures), and the invariances serving relies on: batching, block
//! size, chunked prefill, prefix-cache hits and KV export/import change nothing.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is a failure report

mod common;

use common::{MODELS, Seq, all_logits_step, dir, generate, max_diff, reference};
use dyn_compute::backend::{Backend, KvShape, SeqStep};
use dyn_compute::cpu::CpuBackend;
use dyn_compute::model::{DType, ModelWeights};

fn backend(model: &str, dtype: DType, block_size: usize) -> CpuBackend {
    let w = ModelWeights::load(&dir(model), dtype).unwrap();
    CpuBackend::new(
        w,
        KvShape {
            num_blocks: 256,
            block_size,
        },
    )
    .unwrap()
}

#[test]
fn logits_and_greedy_tokens_match_transformers() {
    for model in MODELS {
        let r = reference(model);
        let mut b = backend(model, DType::F32, 4);
        for (ci, case) in r.prompts.iter().enumerate() {
            let mut s = [Seq::new(&case.prompt, 0, 4, 64)];
            generate(&mut b, &mut s, case.greedy.len(), usize::MAX);
            let [s] = s;
            for (step, want) in case.logits.iter().enumerate() {
                let d = max_diff(&s.logits[step], want);
                assert!(
                    d < 1e-4,
                    "{model} prompt {ci} step {step}: logits differ by {d}"
                );
            }
            assert_eq!(
                &s.tokens[case.prompt.len()..],
                &case.greedy[..],
                "{model} prompt {ci}"
            );
        }
    }
}

/// A prompt's log-probabilities need the logits after every prompt token: with `all_logits`
/// one forward pass over the prompt and the greedy answer gives, at the answer's positions,
/// transformers' logits of each greedy step (in chunks too, batched with a last-only sequence).
#[test]
fn all_logits_rows_match_transformers_at_every_position() {
    for model in MODELS {
        let r = reference(model);
        let mut b = backend(model, DType::F32, 4);
        for (ci, case) in r.prompts.iter().enumerate() {
            let tokens = case.answered();
            let blocks: Vec<u32> = (0..tokens.len().div_ceil(4) as u32).collect();
            let other: Vec<u32> = (100..100 + 8).collect();
            for chunk in [tokens.len(), 3] {
                let mut rows = Vec::new();
                let mut start = 0;
                while start < tokens.len() {
                    let end = (start + chunk).min(tokens.len());
                    let step = all_logits_step(
                        &tokens[start..end],
                        start,
                        &blocks,
                        &case.prompt[..1],
                        &other,
                    );
                    let mut out = b.forward(&step).unwrap();
                    assert_eq!(out.len(), end - start + 1, "one row per token, then one");
                    out.pop();
                    rows.extend(out);
                    start = end;
                }
                for (step, want) in case.logits.iter().enumerate() {
                    let d = max_diff(&rows[case.prompt.len() - 1 + step], want);
                    assert!(
                        d < 1e-4,
                        "{model} prompt {ci} chunk {chunk} step {step}: logits differ by {d}"
                    );
                }
            }
        }
    }
}

#[test]
fn batching_block_size_and_chunked_prefill_change_nothing() {
    for model in MODELS {
        let r = reference(model);
        let steps = r.prompts[0].greedy.len();
        // Alone, whole prompts, blocks of 4: the baseline.
        let alone: Vec<Seq> = r
            .prompts
            .iter()
            .map(|c| {
                let mut b = backend(model, DType::F32, 4);
                let mut s = [Seq::new(&c.prompt, 0, 4, 64)];
                generate(&mut b, &mut s, steps, usize::MAX);
                let [s] = s;
                s
            })
            .collect();
        for (block_size, chunk) in [(4, usize::MAX), (1, usize::MAX), (16, usize::MAX), (4, 3)] {
            let mut b = backend(model, DType::F32, block_size);
            let per = 64usize.div_ceil(block_size) as u32;
            let mut seqs: Vec<Seq> = r
                .prompts
                .iter()
                .enumerate()
                .map(|(i, c)| Seq::new(&c.prompt, i as u32 * per, block_size, 64))
                .collect();
            generate(&mut b, &mut seqs, steps, chunk);
            for (i, (s, a)) in seqs.iter().zip(&alone).enumerate() {
                assert_eq!(
                    s.tokens, a.tokens,
                    "{model} prompt {i}, blocks of {block_size}, chunks of {chunk}"
                );
                for (x, y) in s.logits.iter().zip(&a.logits) {
                    let d = max_diff(x, y);
                    assert!(d < 1e-4, "{model} prompt {i}: batched logits differ by {d}");
                }
            }
        }
    }
}

#[test]
fn a_prefix_cache_hit_gives_the_same_output() {
    let r = reference("tiny");
    let case = &r.prompts[2]; // 21 tokens
    let steps = case.greedy.len();
    let mut b = backend("tiny", DType::F32, 4);
    let mut first = [Seq::new(&case.prompt, 0, 4, 64)];
    generate(&mut b, &mut first, steps, usize::MAX);
    // A second request with the same prompt reuses the first 5 full blocks (20 tokens) and
    // computes only the last prompt token, in fresh blocks after them.
    let mut second = Seq::new(&case.prompt, 100, 4, 64);
    second.blocks[..5].copy_from_slice(&first[0].blocks[..5]);
    second.computed = 20;
    let mut second = [second];
    generate(&mut b, &mut second, steps, usize::MAX);
    assert_eq!(second[0].tokens, first[0].tokens);
    assert_eq!(&second[0].tokens[case.prompt.len()..], &case.greedy[..]);
}

#[test]
fn exported_blocks_continue_the_sequence_on_another_backend() {
    let r = reference("tiny");
    let case = &r.prompts[1];
    // The cache keeps the weights' precision, and blocks move in it.
    for dtype in [DType::F32, DType::Bf16, DType::F16] {
        let mut prefill = backend("tiny", dtype, 4);
        assert_eq!(prefill.kv_dtype(), dtype);
        let mut s = [Seq::new(&case.prompt, 0, 4, 64)];
        generate(&mut prefill, &mut s, 1, usize::MAX);
        let used = case.prompt.len().div_ceil(4);
        let mut decode = backend("tiny", dtype, 4);
        let mut moved = Seq::new(&case.prompt, 50, 4, 64);
        // Packed (what a transfer registers): the same bytes as block by block.
        let packed = prefill.export_blocks_packed(&s[0].blocks[..used]).unwrap();
        assert_eq!(packed.len(), used * prefill.block_bytes());
        for (from, bytes) in s[0].blocks[..used]
            .iter()
            .zip(packed.chunks_exact(prefill.block_bytes()))
        {
            assert!(prefill.export_block(*from).unwrap() == bytes, "{dtype:?}");
        }
        assert!(prefill.export_blocks_packed(&[1 << 30]).is_err());
        for (from, to) in s[0].blocks[..used].iter().zip(&moved.blocks) {
            let bytes = prefill.export_block(*from).unwrap();
            assert_eq!(bytes.len(), decode.block_bytes());
            decode.import_block(*to, &bytes).unwrap();
        }
        moved.computed = case.prompt.len();
        moved.tokens.push(s[0].tokens[case.prompt.len()]);
        moved.logits.push(Vec::new());
        let mut moved = [moved];
        let steps = case.greedy.len();
        generate(&mut decode, &mut moved, steps, usize::MAX);
        // The same as staying on the prefill backend, and for f32 as transformers.
        generate(&mut prefill, &mut s, steps, usize::MAX);
        assert_eq!(moved[0].tokens, s[0].tokens, "{dtype:?}");
        if dtype == DType::F32 {
            assert_eq!(&moved[0].tokens[case.prompt.len()..], &case.greedy[..]);
        }
        assert!(decode.import_block(0, &[0; 3]).is_err());
    }
}

#[test]
fn half_precision_weights_stay_close_to_the_reference() {
    let full = backend("tiny", DType::F32, 4).block_bytes();
    for dtype in [DType::Bf16, DType::F16] {
        let r = reference("tiny");
        let mut b = backend("tiny", dtype, 4);
        assert_eq!(
            b.block_bytes() * 2,
            full,
            "{dtype:?}: a half-precision cache"
        );
        let case = &r.prompts[1];
        let mut s = [Seq::new(&case.prompt, 0, 4, 64)];
        generate(&mut b, &mut s, case.logits.len(), usize::MAX);
        // The prefill's logits, and the decode steps' (which read the half-precision
        // cache) while the tokens are still the reference's.
        let n = case.prompt.len();
        for (step, want) in case.logits.iter().enumerate() {
            if step > 0 && s[0].tokens[n + step - 1] != case.greedy[step - 1] {
                break;
            }
            let d = max_diff(&s[0].logits[step], want);
            let scale = want.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            assert!(
                d < 0.05 * scale.max(1.0),
                "{dtype:?} step {step}: logits differ by {d} (max |logit| {scale})"
            );
        }
    }
}

#[test]
fn bad_batches_are_errors_not_panics() {
    let mut b = backend("tiny", DType::F32, 4);
    let too_few_blocks = SeqStep {
        tokens: &[1, 2, 3, 4, 5],
        start: 0,
        blocks: &[0],
        logits: true,
        all_logits: false,
        hidden: false,
        lora: None,
    };
    assert!(b.forward(&[too_few_blocks]).is_err());
    let bad_token = SeqStep {
        tokens: &[100_000],
        start: 0,
        blocks: &[0],
        logits: true,
        all_logits: false,
        hidden: false,
        lora: None,
    };
    assert!(b.forward(&[bad_token]).is_err());
    let bad_block = SeqStep {
        tokens: &[1],
        start: 0,
        blocks: &[9999],
        logits: true,
        all_logits: false,
        hidden: false,
        lora: None,
    };
    assert!(b.forward(&[bad_block]).is_err());
}
