//! The CUDA backend against the same references as the CPU backend. These tests always
//! compile (with `--features cuda`); where no CUDA driver or GPU is present each one prints
//! `SKIPPED` and passes, so CI (which has no GPU) shows they were not exercised.
//! `scripts/test` runs them with `--nocapture` for that reason.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is a failure report

#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_tests_need_the_cuda_feature() {
    println!(
        "SKIPPED: dyn-compute built without the `cuda` feature (cargo test -p dyn-compute --features cuda)"
    );
}

#[cfg(feature = "cuda")]
mod common;

#[cfg(feature = "cuda")]
mod gpu {
    use super::common::{all_logits_step, dir, max_diff, reference};
    use dyn_compute::backend::{Backend, KvShape, SeqStep};
    use dyn_compute::model::{DType, ModelWeights};
    use dyn_compute::sample::argmax;

    /// The backend, or `None` (with the reason printed) where there is no GPU.
    fn gpu(model: &str, dtype: DType) -> Option<Box<dyn Backend>> {
        let w = ModelWeights::load(&dir(model), dtype).unwrap();
        match dyn_compute::cuda::load(
            &w,
            KvShape {
                num_blocks: 256,
                block_size: 4,
            },
            0,
        ) {
            Ok(b) => Some(b),
            Err(e) => {
                println!("SKIPPED: no usable CUDA device ({e})");
                None
            }
        }
    }

    fn cpu(model: &str) -> Box<dyn Backend> {
        let w = ModelWeights::load(&dir(model), DType::F32).unwrap();
        Box::new(
            dyn_compute::cpu::CpuBackend::new(
                w,
                KvShape {
                    num_blocks: 256,
                    block_size: 4,
                },
            )
            .unwrap(),
        )
    }

    /// A sequence being decoded: tokens, tokens computed, blocks, logits per step.
    type Seq = (Vec<u32>, usize, Vec<u32>, Vec<Vec<f32>>);

    /// Greedy decoding of several prompts batched together; (tokens, logits per step).
    fn greedy(
        b: &mut dyn Backend,
        prompts: &[Vec<u32>],
        steps: usize,
    ) -> Vec<(Vec<u32>, Vec<Vec<f32>>)> {
        let per = 16u32;
        let mut seqs: Vec<Seq> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                (
                    p.clone(),
                    0,
                    (i as u32 * per..(i as u32 + 1) * per).collect(),
                    Vec::new(),
                )
            })
            .collect();
        for _ in 0..steps {
            let batch: Vec<SeqStep<'_>> = seqs
                .iter()
                .map(|(t, c, bl, _)| SeqStep {
                    tokens: &t[*c..],
                    start: *c,
                    blocks: bl,
                    logits: true,
                    all_logits: false,
                    hidden: false,
                    lora: None,
                })
                .collect();
            let logits = b.forward(&batch).unwrap();
            for (s, l) in seqs.iter_mut().zip(logits) {
                s.1 = s.0.len();
                s.0.push(argmax(&l));
                s.3.push(l);
            }
        }
        seqs.into_iter().map(|(t, _, _, l)| (t, l)).collect()
    }

    /// Every position's logits (a prompt's log-probabilities): one row per token of the
    /// sequence that asks for all, in order, then one for a sequence that asks for its last;
    /// the rows at the greedy answer's positions are transformers' logits of each step.
    #[test]
    fn all_logits_rows_match_transformers_at_every_position() {
        let Some(mut b) = gpu("tiny", DType::F32) else {
            return;
        };
        let r = reference("tiny");
        for (ci, case) in r.prompts.iter().enumerate() {
            let tokens = case.answered();
            let blocks: Vec<u32> = (0..tokens.len().div_ceil(4) as u32).collect();
            let other: Vec<u32> = (100..108).collect();
            let step = all_logits_step(&tokens, 0, &blocks, &case.prompt[..1], &other);
            let rows = b.forward(&step).unwrap();
            assert_eq!(rows.len(), tokens.len() + 1, "one row per token, then one");
            for (i, want) in case.logits.iter().enumerate() {
                let d = max_diff(&rows[case.prompt.len() - 1 + i], want);
                assert!(d < 1e-3, "prompt {ci} step {i}: logits differ by {d}");
            }
        }
    }

    /// Final hidden states (what embeddings pool) on the GPU equal the CPU backend's: every
    /// row of a prompt taken in two chunks, beside a sequence that asks for logits in the
    /// same steps.
    #[test]
    fn hidden_state_rows_match_the_cpu_backend_across_chunks() {
        let Some(mut g) = gpu("tiny", DType::F32) else {
            return;
        };
        let mut c = cpu("tiny");
        let r = reference("tiny");
        let tokens = r.prompts[0].answered();
        let blocks: Vec<u32> = (0..tokens.len().div_ceil(4) as u32).collect();
        let other = &r.prompts[1 % r.prompts.len()].prompt;
        let other_blocks: Vec<u32> = (100..100 + other.len().div_ceil(4) as u32).collect();
        let cut = tokens.len() / 2;
        for (start, end) in [(0, cut), (cut, tokens.len())] {
            let step = |b: &mut dyn Backend, with_other: bool| {
                let mut batch = vec![SeqStep {
                    tokens: &tokens[start..end],
                    start,
                    blocks: &blocks,
                    logits: true,
                    all_logits: true,
                    hidden: true,
                    lora: None,
                }];
                if with_other {
                    batch.push(SeqStep {
                        tokens: other,
                        start: 0,
                        blocks: &other_blocks,
                        logits: true,
                        all_logits: false,
                        hidden: false,
                        lora: None,
                    });
                }
                b.forward(&batch).unwrap()
            };
            // The other sequence's prompt runs once, in the first chunk's step.
            let (want, got) = (step(c.as_mut(), start == 0), step(g.as_mut(), start == 0));
            assert_eq!(got.len(), want.len(), "rows of chunk {start}..{end}");
            for (i, (w, g)) in want.iter().zip(&got).enumerate() {
                assert_eq!(g.len(), w.len(), "row {i}'s width");
                let d = max_diff(g, w);
                assert!(d < 1e-3, "chunk {start}..{end} row {i}: differs by {d}");
            }
        }
    }

    #[derive(serde::Deserialize)]
    struct LoraReference {
        prompts: Vec<Vec<u32>>,
        /// By adapter (`base`: none), one per prompt.
        outputs: std::collections::HashMap<String, Vec<LoraOutput>>,
    }

    #[derive(serde::Deserialize)]
    struct LoraOutput {
        greedy: Vec<u32>,
        logits: Vec<f32>,
    }

    /// LoRA adapters on the GPU (models/tiny-lora, from peft): each gives transformers +
    /// peft's prefill logits and greedy tokens alone, and three adapters and the base in one
    /// batch each get their own.
    #[test]
    fn lora_adapters_match_peft_alone_and_in_one_batch() {
        use super::common::{Seq, generate};
        use dyn_compute::model::lora::LoraAdapter;
        let Some(mut b) = gpu("tiny", DType::F32) else {
            return;
        };
        let text = std::fs::read_to_string(dir("tiny-lora").join("reference.json")).unwrap();
        let r: LoraReference = serde_json::from_str(&text).unwrap();
        let c = dyn_compute::model::ModelConfig::load(&dir("tiny")).unwrap();
        let names = ["base", "qv", "all", "mlp"];
        let loaded: Vec<Option<LoraAdapter>> = names
            .iter()
            .map(|n| {
                (*n != "base").then(|| LoraAdapter::load(&dir("tiny-lora").join(n), &c).unwrap())
            })
            .collect();
        for (name, lora) in names.iter().zip(&loaded) {
            for (pi, prompt) in r.prompts.iter().enumerate() {
                let want = &r.outputs[*name][pi];
                let mut s = [Seq {
                    lora: lora.as_ref(),
                    ..Seq::new(prompt, 0, 4, 64)
                }];
                generate(b.as_mut(), &mut s, want.greedy.len(), usize::MAX);
                let d = max_diff(&s[0].logits[0], &want.logits);
                assert!(d < 1e-3, "{name} prompt {pi}: logits differ by {d}");
                assert_eq!(
                    &s[0].tokens[prompt.len()..],
                    &want.greedy[..],
                    "{name} {pi}"
                );
            }
        }
        // All four at once, prefills chunked beside decodes.
        let mut seqs: Vec<Seq<'_>> = names
            .iter()
            .zip(&loaded)
            .enumerate()
            .map(|(i, (_, lora))| Seq {
                lora: lora.as_ref(),
                ..Seq::new(&r.prompts[i % r.prompts.len()], i as u32 * 16, 4, 64)
            })
            .collect();
        generate(b.as_mut(), &mut seqs, 12, 3);
        for (i, (name, s)) in names.iter().zip(&seqs).enumerate() {
            let p = i % r.prompts.len();
            let want = &r.outputs[*name][p].greedy;
            assert_eq!(
                &s.tokens[r.prompts[p].len()..],
                &want[..],
                "{name} in a mixed batch"
            );
        }
    }

    #[test]
    fn kernels_compile_with_nvrtc_for_every_dtype() {
        for dtype in [DType::F32, DType::Bf16, DType::F16] {
            match dyn_compute::cuda::compile_kernels(dtype) {
                Ok(bytes) => println!("{dtype:?}: {bytes} bytes of PTX"),
                // NVRTC is software (a PyPI wheel): the test command provides it, so there
                // a missing NVRTC fails the test; only a bare `cargo test` skips.
                Err(e) if !e.to_string().contains("compiling") => {
                    dyn_tests::skip(&format!("NVRTC cannot be loaded: {e}"));
                    return;
                }
                Err(e) => panic!("{dtype:?}: {e}"),
            }
        }
    }

    #[test]
    fn no_driver_is_an_error_not_a_panic() {
        let w = ModelWeights::load(&dir("tiny"), DType::F32).unwrap();
        match dyn_compute::cuda::load(
            &w,
            KvShape {
                num_blocks: 4,
                block_size: 4,
            },
            0,
        ) {
            Ok(b) => println!("a GPU is present: {}", b.describe()),
            Err(e) => {
                assert!(!dyn_compute::cuda::driver_present() || !e.to_string().is_empty());
                println!("SKIPPED (the error path ran): {e}");
            }
        }
    }

    #[test]
    fn logits_and_greedy_tokens_match_transformers_batched() {
        for model in ["tiny", "tiny-qwen2", "tiny-mistral"] {
            let Some(mut b) = gpu(model, DType::F32) else {
                return;
            };
            let r = reference(model);
            let prompts: Vec<Vec<u32>> = r.prompts.iter().map(|c| c.prompt.clone()).collect();
            let got = greedy(b.as_mut(), &prompts, r.prompts[0].greedy.len());
            for (c, (tokens, logits)) in r.prompts.iter().zip(&got) {
                assert_eq!(&tokens[c.prompt.len()..], &c.greedy[..], "{model}");
                for (step, want) in c.logits.iter().enumerate() {
                    let d = max_diff(&logits[step], want);
                    assert!(d < 1e-3, "{model} step {step}: logits differ by {d}");
                }
            }
        }
    }

    #[test]
    fn kv_blocks_move_between_gpu_and_cpu_backends_of_one_dtype() {
        let Some(mut g) = gpu("tiny", DType::F32) else {
            return;
        };
        let mut c = cpu("tiny");
        assert_eq!(g.block_bytes(), c.block_bytes());
        let r = reference("tiny");
        let case = &r.prompts[1];
        // Prefill on the GPU, move the blocks to the CPU backend, decode there.
        let blocks: Vec<u32> = (0..16).collect();
        let step = SeqStep {
            tokens: &case.prompt,
            start: 0,
            blocks: &blocks,
            logits: true,
            all_logits: false,
            hidden: false,
            lora: None,
        };
        let first = argmax(&g.forward(&[step]).unwrap()[0]);
        assert_eq!(first, case.greedy[0]);
        let used: Vec<u32> = blocks[..case.prompt.len().div_ceil(4)].to_vec();
        let data = g.export_blocks(&used).unwrap();
        let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
        c.import_blocks(&used, &refs).unwrap();
        let mut tokens = case.prompt.clone();
        tokens.push(first);
        let step = SeqStep {
            tokens: &tokens[case.prompt.len()..],
            start: case.prompt.len(),
            blocks: &blocks,
            logits: true,
            all_logits: false,
            hidden: false,
            lora: None,
        };
        assert_eq!(argmax(&c.forward(&[step]).unwrap()[0]), case.greedy[1]);
    }

    #[test]
    fn bf16_weights_stay_close() {
        let Some(mut b) = gpu("tiny", DType::Bf16) else {
            return;
        };
        let r = reference("tiny");
        let got = greedy(b.as_mut(), &[r.prompts[1].prompt.clone()], 1);
        let want = &r.prompts[1].logits[0];
        let scale = want.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        let d = max_diff(&got[0].1[0], want);
        assert!(d < 0.05 * scale.max(1.0), "bf16 logits differ by {d}");
    }
}
