//! Weights from GGUF files (llama.cpp's model format). The file itself, its header, metadata
//! and tensor table, every length and offset checked, is read by `dyn-model`
//! ([`dyn_model::gguf`], re-exported here under its old path); [`GgufWeights::weights`] reads
//! the tensors by their GGUF names into [`ModelWeights`], quantized matrices either kept as
//! they are (the CPU backend multiplies them directly) or widened to a dtype.

pub use dyn_model::gguf::*;

use super::weights::{DType, Host, le_vec};
use super::{LayerParts, LayerWeights, ModelConfig, ModelError, ModelWeights};
use crate::quant::QTensor;

/// A GGUF file's weights, in the layout every backend uses.
pub trait GgufWeights {
    /// Every weight, by GGUF's tensor names. Quantized matrices stay quantized when
    /// `keep_quantized`, otherwise everything is converted to `dtype`; vectors are f32.
    fn weights(
        &self,
        config: ModelConfig,
        dtype: DType,
        keep_quantized: bool,
    ) -> Result<ModelWeights, ModelError>;
}

impl GgufWeights for Gguf {
    fn weights(
        &self,
        config: ModelConfig,
        dtype: DType,
        keep_quantized: bool,
    ) -> Result<ModelWeights, ModelError> {
        let c = &config;
        let (h, d) = (c.hidden, c.head_dim);
        let (qd, kvd) = (c.heads * d, c.kv_heads * d);
        let get =
            |n: &str, rows: usize, cols: usize| matrix(self, n, rows, cols, dtype, keep_quantized);
        let embed = get("token_embd.weight", c.vocab, h)?;
        // llama.cpp's converter interleaves the two rotary halves of each q and k head for
        // llama models (its rope pairs neighbours; this engine, like transformers, pairs
        // halves): put the rows back.
        let unpermute = c.arch != super::Arch::Qwen2;
        let mut layers = Vec::with_capacity(c.layers);
        for l in 0..c.layers {
            let p = |n: &str| format!("blk.{l}.{n}");
            let q = get(&p("attn_q.weight"), qd, h)?;
            let k = get(&p("attn_k.weight"), kvd, h)?;
            let (q, k) = if unpermute {
                (
                    rotary_halves(q, c.heads, d),
                    rotary_halves(k, c.kv_heads, d),
                )
            } else {
                (q, k)
            };
            let qkv_bias = if c.qkv_bias {
                let mut b = vector(self, &p("attn_q.bias"), qd)?;
                b.extend(vector(self, &p("attn_k.bias"), kvd)?);
                b.extend(vector(self, &p("attn_v.bias"), kvd)?);
                Some(b)
            } else {
                None
            };
            let parts = LayerParts {
                attn_norm: vector(self, &p("attn_norm.weight"), h)?,
                q,
                k,
                v: get(&p("attn_v.weight"), kvd, h)?,
                qkv_bias,
                o: get(&p("attn_output.weight"), h, qd)?,
                mlp_norm: vector(self, &p("ffn_norm.weight"), h)?,
                gate: get(&p("ffn_gate.weight"), c.intermediate, h)?,
                up: get(&p("ffn_up.weight"), c.intermediate, h)?,
                down: get(&p("ffn_down.weight"), h, c.intermediate)?,
            };
            layers.push(LayerWeights::fuse(c, parts));
        }
        let lm_head = self
            .has_tensor("output.weight")
            .then(|| get("output.weight", c.vocab, h))
            .transpose()?;
        let norm = vector(self, "output_norm.weight", h)?;
        Ok(ModelWeights::assemble(
            config, dtype, embed, layers, norm, lm_head,
        ))
    }
}

/// Tensor `name` of `g` as a `[rows, cols]` matrix (a vector when `rows` is 1): checked
/// against its table entry, then kept quantized (`keep`), or converted to `dtype`.
fn matrix(
    g: &Gguf,
    name: &str,
    rows: usize,
    cols: usize,
    dtype: DType,
    keep: bool,
) -> Result<Host, ModelError> {
    let t = g.matrix(name, rows, cols)?;
    Ok(match t.ty {
        TensorType::Quant(q) => {
            let qt = QTensor::new(q, rows, cols, t.data.to_vec())
                .map_err(|e| g.err(format!("tensor {name}: {e}")))?;
            if keep {
                Host::Quant(qt)
            } else {
                Host::F32(qt.to_f32()).to(dtype)
            }
        }
        TensorType::F32 => Host::F32(le_vec(t.data)).to(dtype),
        TensorType::F16 => Host::F16(le_vec(t.data)).to(dtype),
        TensorType::Bf16 => Host::Bf16(le_vec(t.data)).to(dtype),
    })
}

fn vector(g: &Gguf, name: &str, len: usize) -> Result<Vec<f32>, ModelError> {
    Ok(matrix(g, name, 1, len, DType::F32, false)?.to_f32())
}

/// Undo llama.cpp's q/k row permutation (see [`rotary_order`]).
fn rotary_halves(m: Host, heads: usize, d: usize) -> Host {
    let order: Vec<Option<usize>> = rotary_order(heads, d).into_iter().map(Some).collect();
    m.select_rows(&order, m.len() / order.len().max(1))
}
