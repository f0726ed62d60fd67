//! Write a random-weight Llama checkpoint (config.json + model.safetensors) of a given shape,
//! for benchmarks: both this engine and Hugging Face transformers load the same files.
//!
//! ```text
//! cargo run --release -p dyn-compute --example random_model -- DIR [hidden layers heads kv_heads intermediate vocab dtype]
//! ```
//! Defaults: the ~100M config of BENCHMARKS.md (768 12 12 4 2048 8192 f32).

use std::collections::HashMap;

use half::bf16;
use safetensors::tensor::{Dtype, TensorView};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dir = std::path::PathBuf::from(args.first().ok_or("usage: random_model DIR [shape...]")?);
    let num = |i: usize, d: usize| -> Result<usize, Box<dyn std::error::Error>> {
        Ok(args.get(i).map(|s| s.parse()).transpose()?.unwrap_or(d))
    };
    let (h, layers, heads, kvh, inter, vocab) = (
        num(1, 768)?,
        num(2, 12)?,
        num(3, 12)?,
        num(4, 4)?,
        num(5, 2048)?,
        num(6, 8192)?,
    );
    let dtype = args.get(7).map_or("f32", String::as_str);
    let (st_dtype, torch) = match dtype {
        "f32" => (Dtype::F32, "float32"),
        "bf16" => (Dtype::BF16, "bfloat16"),
        other => return Err(format!("dtype {other}: f32 or bf16").into()),
    };
    std::fs::create_dir_all(&dir)?;
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": h, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kvh, "vocab_size": vocab,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096,
        "tie_word_embeddings": false, "torch_dtype": torch, "bos_token_id": 0, "eos_token_id": 1,
        "hidden_act": "silu"
    });
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&config)?,
    )?;
    let d = h / heads;
    let mut shapes: Vec<(String, Vec<usize>)> = vec![
        ("model.embed_tokens.weight".into(), vec![vocab, h]),
        ("model.norm.weight".into(), vec![h]),
        ("lm_head.weight".into(), vec![vocab, h]),
    ];
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        for (n, s) in [
            ("self_attn.q_proj.weight", vec![heads * d, h]),
            ("self_attn.k_proj.weight", vec![kvh * d, h]),
            ("self_attn.v_proj.weight", vec![kvh * d, h]),
            ("self_attn.o_proj.weight", vec![h, heads * d]),
            ("mlp.gate_proj.weight", vec![inter, h]),
            ("mlp.up_proj.weight", vec![inter, h]),
            ("mlp.down_proj.weight", vec![h, inter]),
            ("input_layernorm.weight", vec![h]),
            ("post_attention_layernorm.weight", vec![h]),
        ] {
            shapes.push((format!("{p}.{n}"), s));
        }
    }
    // xorshift: fast, reproducible; uniform with the variance of N(0, 1/fan_in).
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    };
    let mut bytes: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, shape) in shapes {
        let n: usize = shape.iter().product();
        let scale = if shape.len() == 1 {
            0.0
        } else {
            (3.0 / shape[1] as f32).sqrt()
        };
        let vals = (0..n).map(|_| {
            if shape.len() == 1 {
                1.0
            } else {
                next() * scale
            }
        });
        let data: Vec<u8> = match st_dtype {
            Dtype::BF16 => vals.flat_map(|v| bf16::from_f32(v).to_le_bytes()).collect(),
            _ => vals.flat_map(f32::to_le_bytes).collect(),
        };
        bytes.push((name, shape, data));
    }
    let views: HashMap<String, TensorView<'_>> = bytes
        .iter()
        .map(|(n, s, b)| Ok((n.clone(), TensorView::new(st_dtype, s.clone(), b)?)))
        .collect::<Result<_, safetensors::SafeTensorError>>()?;
    // transformers wants to know the tensors were written for PyTorch.
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(meta), &dir.join("model.safetensors"))?;
    println!("{}: llama {h}x{layers}, {dtype}", dir.display());
    Ok(())
}
