//! LoRA adapters on the CPU backend against transformers + peft (models/tiny-lora, made by
//! scripts/make-lora-fixtures: three PEFT adapters of models/tiny with random, non-zero A and
//! B), a batch mixing adapters, and adapters that do not fit refused with the reason.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is a failure report

mod common;

use std::collections::HashMap;

use common::{Seq, dir, generate, max_diff};
use dyn_compute::backend::KvShape;
use dyn_compute::cpu::CpuBackend;
use dyn_compute::model::gguf::GgufWeights as _;
use dyn_compute::model::lora::LoraAdapter;
use dyn_compute::model::{DType, ModelConfig, ModelWeights};

#[derive(serde::Deserialize)]
struct Reference {
    prompts: Vec<Vec<u32>>,
    /// By adapter (`base`: none), one per prompt.
    outputs: HashMap<String, Vec<Output>>,
}

#[derive(serde::Deserialize)]
struct Output {
    greedy: Vec<u32>,
    logits: Vec<f32>,
}

const ADAPTERS: [&str; 3] = ["qv", "all", "mlp"];

fn reference() -> Reference {
    let text = std::fs::read_to_string(dir("tiny-lora").join("reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn backend() -> CpuBackend {
    let w = ModelWeights::load(&dir("tiny"), DType::F32).unwrap();
    let kv = KvShape {
        num_blocks: 256,
        block_size: 4,
    };
    CpuBackend::new(w, kv).unwrap()
}

fn config() -> ModelConfig {
    ModelConfig::load(&dir("tiny")).unwrap()
}

fn adapter(name: &str) -> LoraAdapter {
    LoraAdapter::load_peft(&dir("tiny-lora").join(name), &config()).unwrap()
}

/// A sequence on blocks of its own (`slot`), with `lora`.
fn seq<'a>(prompt: &[u32], slot: u32, lora: Option<&'a LoraAdapter>) -> Seq<'a> {
    Seq {
        lora,
        ..Seq::new(prompt, slot * 16, 4, 64)
    }
}

#[test]
fn adapters_give_what_transformers_and_peft_give() {
    let r = reference();
    let mut b = backend();
    let loaded: Vec<(String, Option<LoraAdapter>)> = std::iter::once(("base".to_owned(), None))
        .chain(ADAPTERS.iter().map(|a| (a.to_string(), Some(adapter(a)))))
        .collect();
    for (name, lora) in &loaded {
        for (pi, prompt) in r.prompts.iter().enumerate() {
            let want = &r.outputs[name][pi];
            let mut s = [seq(prompt, 0, lora.as_ref())];
            generate(&mut b, &mut s, want.greedy.len(), usize::MAX);
            let d = max_diff(&s[0].logits[0], &want.logits);
            assert!(d < 1e-4, "{name} prompt {pi}: prefill logits differ by {d}");
            assert_eq!(
                &s[0].tokens[prompt.len()..],
                &want.greedy[..],
                "{name} prompt {pi}"
            );
        }
    }
    // Each adapter changes every continuation: the test above would catch an adapter ignored.
    for name in ADAPTERS {
        for (pi, out) in r.outputs[name].iter().enumerate() {
            assert_ne!(out.greedy, r.outputs["base"][pi].greedy, "{name} {pi}");
        }
    }
}

/// Three adapters and the base in the same steps (chunked prefills beside decodes): each
/// sequence gets the tokens it gets alone.
#[test]
fn a_batch_mixing_three_adapters_and_the_base_gives_each_its_own_tokens() {
    let r = reference();
    let adapters: Vec<LoraAdapter> = ADAPTERS.iter().map(|a| adapter(a)).collect();
    let mut b = backend();
    let names = ["base", "qv", "all", "mlp"];
    let mut seqs: Vec<Seq<'_>> = Vec::new();
    for (slot, (pi, name)) in [
        (0, "base"),
        (1, "qv"),
        (2, "all"),
        (0, "mlp"),
        (1, "all"),
        (2, "base"),
    ]
    .into_iter()
    .enumerate()
    {
        let lora = names
            .iter()
            .position(|n| *n == name)
            .and_then(|i| i.checked_sub(1))
            .map(|i| &adapters[i]);
        seqs.push(seq(&r.prompts[pi], slot as u32, lora));
    }
    generate(&mut b, &mut seqs, 12, 3);
    for (s, (pi, name)) in seqs.iter().zip([
        (0, "base"),
        (1, "qv"),
        (2, "all"),
        (0, "mlp"),
        (1, "all"),
        (2, "base"),
    ]) {
        let prompt = &r.prompts[pi];
        assert_eq!(
            &s.tokens[prompt.len()..],
            &r.outputs[name][pi].greedy[..],
            "{name} prompt {pi} in a mixed batch"
        );
    }
}

/// A fresh directory under the target directory with an adapter's files.
fn scratch(name: &str, config: &str, tensors: &[(&str, Vec<usize>)]) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("dyn-lora-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(d.join("adapter_config.json"), config).unwrap();
    let data: Vec<(String, Vec<u8>, Vec<usize>)> = tensors
        .iter()
        .map(|(n, shape)| {
            let len: usize = shape.iter().product();
            (n.to_string(), vec![0u8; 4 * len], shape.clone())
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = data
        .iter()
        .map(|(n, bytes, shape)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), bytes)
                    .unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &d.join("adapter_model.safetensors")).unwrap();
    d
}

#[test]
fn adapters_that_do_not_fit_are_refused_with_the_reason() {
    let c = config();
    let err = |d: &std::path::Path| LoraAdapter::load_peft(d, &c).unwrap_err().to_string();
    let ok = r#"{"peft_type": "LORA", "r": 2, "lora_alpha": 4}"#;
    let q = "base_model.model.model.layers.0.self_attn.q_proj";
    // Another model's shapes (hidden 128 where tiny has 64).
    let d = scratch(
        "shape",
        ok,
        &[
            (&format!("{q}.lora_A.weight"), vec![2, 128]),
            (&format!("{q}.lora_B.weight"), vec![64, 2]),
        ],
    );
    let e = err(&d);
    assert!(
        e.contains("has shape [2, 128]")
            && e.contains("needs [r, 64]")
            && e.contains("another model"),
        "{e}"
    );
    // A layer the model does not have.
    let q9 = "base_model.model.model.layers.9.self_attn.q_proj";
    let d = scratch(
        "layer",
        ok,
        &[
            (&format!("{q9}.lora_A.weight"), vec![2, 64]),
            (&format!("{q9}.lora_B.weight"), vec![64, 2]),
        ],
    );
    assert!(
        err(&d).contains("for layer 9; the base model has 2"),
        "{}",
        err(&d)
    );
    // Half a pair.
    let d = scratch("half", ok, &[(&format!("{q}.lora_A.weight"), vec![2, 64])]);
    assert!(
        err(&d).contains("only one of lora_A and lora_B"),
        "{}",
        err(&d)
    );
    // Something other than a projection (an embedding adapter).
    let d = scratch(
        "embed",
        ok,
        &[(
            "base_model.model.model.embed_tokens.lora_embedding_A",
            vec![2, 689],
        )],
    );
    assert!(err(&d).contains("is not a LoRA A or B"), "{}", err(&d));
    // Another tower's layers, and the same half twice.
    let d = scratch(
        "tower",
        ok,
        &[(
            "base_model.model.vision_model.encoder.layers.0.self_attn.q_proj.lora_A.weight",
            vec![2, 64],
        )],
    );
    assert!(err(&d).contains("is not a LoRA A or B"), "{}", err(&d));
    let d = scratch(
        "twice",
        ok,
        &[
            (&format!("{q}.lora_A.weight"), vec![2, 64]),
            ("model.layers.0.self_attn.q_proj.lora_A.weight", vec![2, 64]),
        ],
    );
    assert!(err(&d).contains("has two lora_A"), "{}", err(&d));
    // Kinds of adapter not supported.
    for (cfg, says) in [
        (r#"{"r": 2, "lora_alpha": 4, "use_dora": true}"#, "DoRA"),
        (
            r#"{"r": 2, "lora_alpha": 4, "modules_to_save": ["lm_head"]}"#,
            "modules_to_save",
        ),
        (
            r#"{"peft_type": "IA3", "r": 2, "lora_alpha": 4}"#,
            "not LORA",
        ),
        (r#"{"r": 0, "lora_alpha": 4}"#, "r must be 1 to"),
        (
            r#"{"r": 2, "lora_alpha": 4, "layer_replication": [[0, 2]]}"#,
            "not supported",
        ),
        (r#"{"lora_alpha": 4}"#, "missing field `r`"),
    ] {
        let d = scratch(
            "kind",
            cfg,
            &[
                (&format!("{q}.lora_A.weight"), vec![2, 64]),
                (&format!("{q}.lora_B.weight"), vec![64, 2]),
            ],
        );
        assert!(err(&d).contains(says), "{cfg}: {}", err(&d));
    }
    // No directory at all.
    let e = err(std::path::Path::new("/nonexistent/adapter"));
    assert!(
        e.contains("/nonexistent/adapter/adapter_config.json"),
        "{e}"
    );
}

/// The same adapters as llama.cpp's converter writes them (models/tiny-lora/*.gguf, from the
/// PEFT directories): `qv` gives transformers + peft's tokens and logits; `all` holds the same
/// matrices (k's and q's rows put back in order) at llama.cpp's scale, alpha / rank, where PEFT's
/// rslora scale is alpha / √rank.
#[test]
fn gguf_lora_files_hold_the_same_adapters() {
    let c = config();
    let gguf = |name: &str| LoraAdapter::load(&dir("tiny-lora").join(format!("{name}.gguf")), &c);
    let qv = gguf("qv").unwrap();
    let r = reference();
    let mut b = backend();
    for (pi, prompt) in r.prompts.iter().enumerate() {
        let want = &r.outputs["qv"][pi];
        let mut s = [seq(prompt, 0, Some(&qv))];
        generate(&mut b, &mut s, want.greedy.len(), usize::MAX);
        let d = max_diff(&s[0].logits[0], &want.logits);
        assert!(
            d < 1e-4,
            "qv.gguf prompt {pi}: prefill logits differ by {d}"
        );
        assert_eq!(
            &s[0].tokens[prompt.len()..],
            &want.greedy[..],
            "qv.gguf {pi}"
        );
    }
    let (peft, all) = (adapter("all"), gguf("all").unwrap());
    // rank 4: PEFT's scale 8 / 2, llama.cpp's 8 / 4.
    let ratio = 0.5;
    for l in 0..c.layers {
        for t in dyn_compute::model::lora::Target::ALL {
            let (p, g) = (peft.pair(l, t).unwrap(), all.pair(l, t).unwrap());
            assert_eq!((p.rank, p.inp, p.out), (g.rank, g.inp, g.out));
            assert!(max_diff(&p.at, &g.at) < 1e-6, "layer {l} {t:?}: A");
            let scaled: Vec<f32> = p.bt.iter().map(|x| x * ratio).collect();
            assert!(max_diff(&scaled, &g.bt) < 1e-6, "layer {l} {t:?}: B");
        }
    }
    // A model file is no adapter (where the test command provides one); an adapter of another
    // shape is refused naming a tensor.
    if let Some(model) = std::env::var_os("DYN_SMOLLM2_GGUF") {
        let e = LoraAdapter::load(std::path::Path::new(&model), &c).unwrap_err();
        assert!(e.to_string().contains("not a LoRA adapter"), "{e}");
    }
    let mut small = c.clone();
    small.hidden /= 2;
    let e = LoraAdapter::load(&dir("tiny-lora").join("qv.gguf"), &small).unwrap_err();
    assert!(
        e.to_string().contains("an adapter for another model?"),
        "{e}"
    );
}

#[derive(serde::Deserialize)]
struct SmolLora {
    cases: Vec<SmolCase>,
}

#[derive(serde::Deserialize)]
struct SmolCase {
    prompt: Vec<u32>,
    /// transformers + peft's greedy continuation with the adapter, and without.
    greedy: Vec<u32>,
    base: Vec<u32>,
}

/// SmolLM2-135M-Instruct with a rank-2 adapter on q and v (models/smollm2-lora, made with peft
/// by scripts/make-lora-fixtures on the HF directory scripts/test makes from the Q4_1 GGUF):
/// on the GGUF's weights dequantized to f32, the greedy continuations equal transformers +
/// peft's; on the quantized path (Q4_1 products with 8-bit activations, the adapter in f32)
/// the agreement is printed and bounded: fed peft's tokens, at least 90 % of the steps choose
/// peft's next one.
#[test]
fn an_adapter_on_smollm2_agrees_with_peft_in_f32_and_on_the_quantized_base() {
    let Some(path) = std::env::var_os("DYN_SMOLLM2_GGUF").map(std::path::PathBuf::from) else {
        dyn_tests::skip("DYN_SMOLLM2_GGUF is not set (scripts/test fetches the model)");
        return;
    };
    let g = dyn_compute::model::gguf::Gguf::open(&path).unwrap();
    let c = g.config().unwrap();
    let lora = LoraAdapter::load(&dir("smollm2-lora").join("qv"), &c).unwrap();
    let text = std::fs::read_to_string(dir("smollm2-lora").join("reference.json")).unwrap();
    let r: SmolLora = serde_json::from_str(&text).unwrap();
    let kv = KvShape {
        num_blocks: 64,
        block_size: 16,
    };
    let f32w = g.weights(c.clone(), DType::F32, false).unwrap();
    let qw = g.weights(c, DType::F32, true).unwrap();
    let (mut prefix, mut same, mut total) = (0, 0, 0);
    for case in &r.cases {
        assert_ne!(case.greedy, case.base, "the adapter changes the answer");
        let n = case.greedy.len();
        let mut exact = CpuBackend::new(f32w.clone(), kv).unwrap();
        let mut s = [seq(&case.prompt, 0, Some(&lora))];
        generate(&mut exact, &mut s, n, usize::MAX);
        assert_eq!(&s[0].tokens[case.prompt.len()..], &case.greedy[..], "f32");

        let mut quant = CpuBackend::new(qw.clone(), kv).unwrap();
        let mut s = [seq(&case.prompt, 0, Some(&lora))];
        generate(&mut quant, &mut s, n, usize::MAX);
        prefix += s[0].tokens[case.prompt.len()..]
            .iter()
            .zip(&case.greedy)
            .take_while(|(a, b)| a == b)
            .count();
        let mut quant = CpuBackend::new(qw.clone(), kv).unwrap();
        let choices = common::forced(&mut quant, &case.prompt, &case.greedy, Some(&lora));
        same += choices
            .iter()
            .zip(&case.greedy)
            .filter(|(a, b)| a == b)
            .count();
        total += n;
    }
    eprintln!(
        "SmolLM2 Q4_1 + LoRA vs transformers + peft (f32): {prefix} of {total} greedy tokens before the first divergence; fed peft's tokens, {same} of {total} steps choose its token"
    );
    assert!(same * 10 >= total * 9, "{same} of {total}");
}
