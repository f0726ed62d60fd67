//! Loading a Llama-family checkpoint: its shape ([`config`]) and its weights
//! ([`weights`]), gathered into [`ModelWeights`] in the layout every backend uses: q, k and v
//! projections fused into one matrix, gate and up fused into another, so a layer is four
//! matrix products. [`lora`] reads LoRA adapters, which backends add to those products,
//! through [`files`], which bounds what a named file can make the process read.
//!
//! The file formats themselves ([`config`], [`files`], [`lora`], GGUF's reader, [`shape`] and
//! [`ModelError`]) are `dyn-model`'s, so that the serving side reads them without compiling
//! kernels; they are re-exported here under their old paths. What needs the kernels' types
//! stays here: [`weights`], and turning a GGUF file's tensors into weights ([`gguf`]).

pub use dyn_model::{ModelError, config, files, lora, shape};
pub mod gguf;
pub mod weights;

use std::path::Path;

pub use config::{Arch, ModelConfig, RopeScaling};
use gguf::GgufWeights as _;
pub use weights::{Checkpoint, DType, Host};

/// A matrix `[rows, cols]` (row-major, as `nn.Linear` stores `[out, in]`) with optional bias.
#[derive(Debug, Clone)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub data: Host,
    pub bias: Option<Vec<f32>>,
}

/// One layer's tensors as a checkpoint holds them, before fusing.
pub(crate) struct LayerParts {
    pub attn_norm: Vec<f32>,
    pub q: Host,
    pub k: Host,
    pub v: Host,
    /// q, k and v's biases, concatenated.
    pub qkv_bias: Option<Vec<f32>>,
    pub o: Host,
    pub mlp_norm: Vec<f32>,
    pub gate: Host,
    pub up: Host,
    pub down: Host,
}

impl LayerWeights {
    /// Fuse q/k/v and gate/up, shaped by `c` (whatever format the parts came from).
    pub(crate) fn fuse(c: &ModelConfig, p: LayerParts) -> LayerWeights {
        let (h, qd, kvd) = (c.hidden, c.heads * c.head_dim, c.kv_heads * c.head_dim);
        let matrix = |rows, cols, data, bias| Matrix {
            rows,
            cols,
            data,
            bias,
        };
        LayerWeights {
            attn_norm: p.attn_norm,
            qkv: matrix(qd + 2 * kvd, h, Host::concat(&[p.q, p.k, p.v]), p.qkv_bias),
            o: matrix(h, qd, p.o, None),
            mlp_norm: p.mlp_norm,
            gate_up: matrix(2 * c.intermediate, h, Host::concat(&[p.gate, p.up]), None),
            down: matrix(h, c.intermediate, p.down, None),
        }
    }
}

#[derive(Debug, Clone)]
pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    /// q, k, v stacked: `[(heads + 2 kv_heads) · head_dim, hidden]`.
    pub qkv: Matrix,
    pub o: Matrix,
    pub mlp_norm: Vec<f32>,
    /// gate, up stacked: `[2 · intermediate, hidden]`.
    pub gate_up: Matrix,
    pub down: Matrix,
}

/// Every weight of a model, in the kept dtype (norms and biases in f32) or, from a GGUF file,
/// matrices possibly still quantized.
#[derive(Debug, Clone)]
pub struct ModelWeights {
    pub config: ModelConfig,
    /// The dense element type: of every unquantized matrix, and of the KV cache.
    pub dtype: DType,
    /// `[vocab, hidden]`.
    pub embed: Host,
    pub layers: Vec<LayerWeights>,
    pub norm: Vec<f32>,
    /// `[vocab, hidden]` (the embedding again when tied).
    pub lm_head: Matrix,
}

impl ModelWeights {
    /// Load `dir` (config.json and safetensors), keeping matrices as `dtype`; or a `.gguf`
    /// file, every matrix converted to `dtype`.
    pub fn load(path: &Path, dtype: DType) -> Result<Self, ModelError> {
        if gguf::is_gguf(path) {
            let g = gguf::Gguf::open(path)?;
            return g.weights(g.config()?, dtype, false);
        }
        let config = ModelConfig::load(path)?;
        let ck = Checkpoint::open(path)?;
        Self::from_checkpoint(config, &ck, dtype)
    }

    pub fn from_checkpoint(
        config: ModelConfig,
        ck: &Checkpoint,
        dtype: DType,
    ) -> Result<Self, ModelError> {
        let c = &config;
        let (h, d) = (c.hidden, c.head_dim);
        let (qd, kvd) = (c.heads * d, c.kv_heads * d);
        let embed = ck.get("model.embed_tokens.weight", &[c.vocab, h], dtype)?;
        let mut layers = Vec::with_capacity(c.layers);
        for l in 0..c.layers {
            let p = format!("model.layers.{l}");
            let get = |n: &str, shape: &[usize]| ck.get(&format!("{p}.{n}"), shape, dtype);
            let vector = |n: &str, len: usize| ck.get_f32(&format!("{p}.{n}"), &[len]);
            let qkv_bias = if c.qkv_bias {
                let mut b = vector("self_attn.q_proj.bias", qd)?;
                b.extend(vector("self_attn.k_proj.bias", kvd)?);
                b.extend(vector("self_attn.v_proj.bias", kvd)?);
                Some(b)
            } else {
                None
            };
            let parts = LayerParts {
                attn_norm: vector("input_layernorm.weight", h)?,
                q: get("self_attn.q_proj.weight", &[qd, h])?,
                k: get("self_attn.k_proj.weight", &[kvd, h])?,
                v: get("self_attn.v_proj.weight", &[kvd, h])?,
                qkv_bias,
                o: get("self_attn.o_proj.weight", &[h, qd])?,
                mlp_norm: vector("post_attention_layernorm.weight", h)?,
                gate: get("mlp.gate_proj.weight", &[c.intermediate, h])?,
                up: get("mlp.up_proj.weight", &[c.intermediate, h])?,
                down: get("mlp.down_proj.weight", &[h, c.intermediate])?,
            };
            layers.push(LayerWeights::fuse(c, parts));
        }
        // Some tied checkpoints still carry lm_head; others omit it.
        let lm_head = (!c.tie_embeddings || ck.contains("lm_head.weight"))
            .then(|| ck.get("lm_head.weight", &[c.vocab, h], dtype))
            .transpose()?;
        let norm = ck.get_f32("model.norm.weight", &[h])?;
        Ok(ModelWeights::assemble(
            config, dtype, embed, layers, norm, lm_head,
        ))
    }

    /// The whole model from its parts; `lm_head` `None`: tied to the embedding.
    pub(crate) fn assemble(
        config: ModelConfig,
        dtype: DType,
        embed: Host,
        layers: Vec<LayerWeights>,
        norm: Vec<f32>,
        lm_head: Option<Host>,
    ) -> ModelWeights {
        let lm_head = Matrix {
            rows: config.vocab,
            cols: config.hidden,
            data: lm_head.unwrap_or_else(|| embed.clone()),
            bias: None,
        };
        ModelWeights {
            config,
            dtype,
            embed,
            layers,
            norm,
            lm_head,
        }
    }

    /// Bytes of weights one decode step reads (every matrix once; one embedding row).
    pub fn bytes_per_token(&self) -> usize {
        let m = |x: &Matrix| x.data.bytes();
        self.layers
            .iter()
            .map(|l| m(&l.qkv) + m(&l.o) + m(&l.gate_up) + m(&l.down))
            .sum::<usize>()
            + m(&self.lm_head)
    }
}

impl Host {
    /// Stack tensors end to end (rows of matrices with equal columns), in the first one's
    /// dtype; the others are converted if they differ. Quantized parts stay quantized when
    /// all are (each row keeps its type), and are widened to f32 when mixed with dense ones.
    pub fn concat(parts: &[Host]) -> Host {
        fn cat<T: Copy>(
            parts: &[Host],
            own: fn(&Host) -> Option<&Vec<T>>,
            from: fn(f32) -> T,
        ) -> Vec<T> {
            let mut out = Vec::with_capacity(parts.iter().map(Host::len).sum());
            for p in parts {
                match own(p) {
                    Some(v) => out.extend_from_slice(v),
                    None => out.extend(p.to_f32().into_iter().map(from)),
                }
            }
            out
        }
        let quant: Vec<&crate::quant::QTensor> = parts
            .iter()
            .filter_map(|p| {
                if let Host::Quant(q) = p {
                    Some(q)
                } else {
                    None
                }
            })
            .collect();
        if quant.len() == parts.len()
            && let Ok(q) = crate::quant::QTensor::concat(&quant)
        {
            return Host::Quant(q);
        }
        match parts.first() {
            Some(Host::Bf16(_)) => Host::Bf16(cat(
                parts,
                |p| if let Host::Bf16(v) = p { Some(v) } else { None },
                half::bf16::from_f32,
            )),
            Some(Host::F16(_)) => Host::F16(cat(
                parts,
                |p| if let Host::F16(v) = p { Some(v) } else { None },
                half::f16::from_f32,
            )),
            _ => Host::F32(cat(
                parts,
                |p| if let Host::F32(v) = p { Some(v) } else { None },
                |x| x,
            )),
        }
    }
}
