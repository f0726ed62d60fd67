//! A model's shape, read from a Hugging Face `config.json`.
//!
//! Three architectures share one transformer here: `llama` (and everything shaped like it),
//! `qwen2` (bias on the q/k/v projections) and `mistral` (optionally a sliding attention
//! window). The raw file is parsed into [`HfConfig`] and checked into [`ModelConfig`], whose
//! fields are all known and consistent, so the backends never meet an impossible shape.

use std::path::Path;

use serde::Deserialize;

use super::ModelError;

/// The transformer families this engine runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
    Mistral,
}

/// How rope frequencies are stretched for long contexts.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Positions divided by `factor`.
    Linear { factor: f32 },
    /// Llama 3.1's wavelength-dependent scaling.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position_embeddings: f32,
    },
}

/// A checked model shape.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub rms_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: Option<RopeScaling>,
    pub tie_embeddings: bool,
    /// Bias on the q, k and v projections (qwen2; llama's `attention_bias`).
    pub qkv_bias: bool,
    /// Attend only to this many most recent positions (mistral's `sliding_window`).
    pub sliding_window: Option<usize>,
    pub max_position: usize,
    /// The dtype the checkpoint declares (`torch_dtype`), if any.
    pub torch_dtype: Option<String>,
}

/// `config.json` as Hugging Face writes it (the fields this engine reads).
#[derive(Debug, Clone, Deserialize)]
pub struct HfConfig {
    pub model_type: Option<String>,
    #[serde(default)]
    pub architectures: Vec<String>,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: Option<usize>,
    pub head_dim: Option<usize>,
    pub vocab_size: usize,
    #[serde(default = "d_eps")]
    pub rms_norm_eps: f32,
    /// Absent in configs transformers 5 writes: they keep it in `rope_parameters`.
    #[serde(default)]
    pub rope_theta: Option<f32>,
    pub rope_scaling: Option<serde_json::Value>,
    /// transformers 5's form of the two above: `{rope_theta, rope_type, …scaling fields}`.
    #[serde(default)]
    pub rope_parameters: Option<serde_json::Value>,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    pub attention_bias: Option<bool>,
    pub sliding_window: Option<usize>,
    pub use_sliding_window: Option<bool>,
    #[serde(default = "d_max_pos")]
    pub max_position_embeddings: usize,
    pub torch_dtype: Option<String>,
    pub hidden_act: Option<String>,
}

fn d_eps() -> f32 {
    1e-6
}
fn d_max_pos() -> usize {
    2048
}

impl ModelConfig {
    /// Read and check `dir/config.json`.
    pub fn load(dir: &Path) -> Result<Self, ModelError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
        let raw: HfConfig = serde_json::from_str(&text)
            .map_err(|e| ModelError::Config(format!("{}: {e}", path.display())))?;
        Self::from_hf(&raw).map_err(|e| ModelError::Config(format!("{}: {e}", path.display())))
    }

    /// Check a parsed `config.json`.
    pub fn from_hf(c: &HfConfig) -> Result<Self, String> {
        let kind = c
            .model_type
            .clone()
            .or_else(|| {
                c.architectures
                    .first()
                    .map(|a| a.trim_end_matches("ForCausalLM").to_lowercase())
            })
            .ok_or("neither model_type nor architectures says what the model is")?;
        let arch = match kind.as_str() {
            "llama" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "mistral" => Arch::Mistral,
            other => {
                return Err(format!(
                    "model_type {other:?} is not supported (llama, qwen2, mistral)"
                ));
            }
        };
        if let Some(act) = &c.hidden_act
            && act != "silu"
        {
            return Err(format!("hidden_act {act:?} is not supported (silu)"));
        }
        let kv_heads = c.num_key_value_heads.unwrap_or(c.num_attention_heads);
        for (name, v) in [
            ("hidden_size", c.hidden_size),
            ("intermediate_size", c.intermediate_size),
            ("num_hidden_layers", c.num_hidden_layers),
            ("num_attention_heads", c.num_attention_heads),
            ("num_key_value_heads", kv_heads),
            ("vocab_size", c.vocab_size),
        ] {
            if v == 0 {
                return Err(format!("{name} must be at least 1"));
            }
        }
        if !c.num_attention_heads.is_multiple_of(kv_heads) {
            return Err(format!(
                "num_attention_heads ({}) is not a multiple of num_key_value_heads ({kv_heads})",
                c.num_attention_heads
            ));
        }
        let head_dim = match c.head_dim {
            Some(d) => d,
            None if c.hidden_size.is_multiple_of(c.num_attention_heads) => {
                c.hidden_size / c.num_attention_heads
            }
            None => {
                return Err(format!(
                    "hidden_size ({}) is not a multiple of num_attention_heads ({})",
                    c.hidden_size, c.num_attention_heads
                ));
            }
        };
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(format!("head_dim ({head_dim}) must be even and positive"));
        }
        if !(c.rms_norm_eps.is_finite() && c.rms_norm_eps > 0.0) {
            return Err("rms_norm_eps must be a positive number".into());
        }
        // transformers 5 writes rope_theta and the scaling into `rope_parameters`.
        let params = c.rope_parameters.as_ref().filter(|p| p.is_object());
        let rope_theta = match (c.rope_theta, params) {
            (Some(t), _) => t,
            (None, Some(p)) => p
                .get("rope_theta")
                .and_then(serde_json::Value::as_f64)
                .map(|t| t as f32)
                .ok_or("rope_parameters has no rope_theta (rope parameters per layer type are not supported)")?,
            (None, None) => 10000.0,
        };
        if !(rope_theta.is_finite() && rope_theta > 0.0) {
            return Err("rope_theta must be a positive number".into());
        }
        let rope_scaling = match (&c.rope_scaling, params) {
            (None | Some(serde_json::Value::Null), None) => None,
            (None | Some(serde_json::Value::Null), Some(p)) => parse_scaling(p)?,
            (Some(v), _) => parse_scaling(v)?,
        };
        let sliding_window = match arch {
            // Qwen2 checkpoints carry a window but switch it off unless told.
            Arch::Qwen2 if c.use_sliding_window != Some(true) => None,
            _ => c.sliding_window.filter(|w| *w > 0),
        };
        Ok(ModelConfig {
            arch,
            hidden: c.hidden_size,
            intermediate: c.intermediate_size,
            layers: c.num_hidden_layers,
            heads: c.num_attention_heads,
            kv_heads,
            head_dim,
            vocab: c.vocab_size,
            rms_eps: c.rms_norm_eps,
            rope_theta,
            rope_scaling,
            tie_embeddings: c.tie_word_embeddings,
            qkv_bias: c.attention_bias.unwrap_or(arch == Arch::Qwen2),
            sliding_window,
            max_position: c.max_position_embeddings,
            torch_dtype: c.torch_dtype.clone(),
        })
    }

    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.heads / self.kv_heads
    }

    /// Rope's inverse frequencies, one per pair of dimensions, with scaling applied.
    pub fn inv_freq(&self) -> Vec<f32> {
        let d = self.head_dim;
        let base: Vec<f32> = (0..d / 2)
            .map(|i| 1.0 / self.rope_theta.powf((2 * i) as f32 / d as f32))
            .collect();
        match &self.rope_scaling {
            None => base,
            Some(RopeScaling::Linear { factor }) => base.iter().map(|f| f / factor).collect(),
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old,
            }) => {
                let low_wavelen = old / low_freq_factor;
                let high_wavelen = old / high_freq_factor;
                base.iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f32::consts::PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (old / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
        }
    }

    /// Parameters in the checkpoint (for bandwidth figures).
    pub fn parameters(&self) -> usize {
        let (h, i, d) = (self.hidden, self.intermediate, self.head_dim);
        let attn = h * self.heads * d * 2 + h * self.kv_heads * d * 2;
        let layer = attn + 3 * h * i + 2 * h;
        let head = if self.tie_embeddings {
            0
        } else {
            self.vocab * h
        };
        self.layers * layer + self.vocab * h + head + h
    }
}

fn parse_scaling(v: &serde_json::Value) -> Result<Option<RopeScaling>, String> {
    let kind = v
        .get("rope_type")
        .or_else(|| v.get("type"))
        .and_then(|t| t.as_str())
        .unwrap_or("default");
    let num = |name: &str| -> Result<f32, String> {
        v.get(name)
            .and_then(|x| x.as_f64())
            .map(|x| x as f32)
            .filter(|x| x.is_finite() && *x > 0.0)
            .ok_or_else(|| format!("rope_scaling ({kind}) needs a positive {name}"))
    };
    match kind {
        "default" => Ok(None),
        "linear" => Ok(Some(RopeScaling::Linear {
            factor: num("factor")?,
        })),
        "llama3" => {
            let s = RopeScaling::Llama3 {
                factor: num("factor")?,
                low_freq_factor: num("low_freq_factor")?,
                high_freq_factor: num("high_freq_factor")?,
                original_max_position_embeddings: num("original_max_position_embeddings")?,
            };
            if let RopeScaling::Llama3 {
                low_freq_factor: l,
                high_freq_factor: h,
                ..
            } = s
                && h <= l
            {
                return Err("rope_scaling: high_freq_factor must exceed low_freq_factor".into());
            }
            Ok(Some(s))
        }
        other => Err(format!(
            "rope_scaling type {other:?} is not supported (default, linear, llama3)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hf(extra: serde_json::Value) -> Result<ModelConfig, String> {
        let mut v = serde_json::json!({
            "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 100
        });
        for (k, x) in extra.as_object().into_iter().flatten() {
            v[k] = x.clone();
        }
        ModelConfig::from_hf(&serde_json::from_value(v).map_err(|e| e.to_string())?)
    }

    #[test]
    fn reads_llama_qwen2_and_mistral_shapes() {
        let l = hf(serde_json::json!({})).unwrap();
        assert_eq!(
            (l.arch, l.head_dim, l.group(), l.qkv_bias),
            (Arch::Llama, 16, 2, false)
        );
        let q = hf(serde_json::json!({"model_type": "qwen2", "sliding_window": 4096})).unwrap();
        assert_eq!(
            (q.arch, q.qkv_bias, q.sliding_window),
            (Arch::Qwen2, true, None)
        );
        let m = hf(serde_json::json!({"model_type": "mistral", "sliding_window": 4096})).unwrap();
        assert_eq!((m.arch, m.sliding_window), (Arch::Mistral, Some(4096)));
        let a = hf(serde_json::json!({"model_type": null, "architectures": ["Qwen2ForCausalLM"]}))
            .unwrap();
        assert_eq!(a.arch, Arch::Qwen2);
    }

    #[test]
    fn rejects_what_it_cannot_run_with_a_reason() {
        for (extra, says) in [
            (serde_json::json!({"model_type": "gpt2"}), "not supported"),
            (serde_json::json!({"num_key_value_heads": 3}), "multiple"),
            (serde_json::json!({"hidden_act": "gelu"}), "hidden_act"),
            (
                serde_json::json!({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}),
                "yarn",
            ),
            (
                serde_json::json!({"rope_scaling": {"rope_type": "linear"}}),
                "factor",
            ),
        ] {
            let e = hf(extra.clone()).unwrap_err();
            assert!(e.contains(says), "{extra}: {e}");
        }
    }

    #[test]
    fn llama3_scaling_keeps_high_frequencies_and_divides_low_ones() {
        let c = hf(
            serde_json::json!({"rope_scaling": {"rope_type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}, "rope_theta": 500000.0}),
        )
        .unwrap();
        let plain = ModelConfig {
            rope_scaling: None,
            ..c.clone()
        };
        let (s, p) = (c.inv_freq(), plain.inv_freq());
        assert_eq!(s[0], p[0]);
        assert!((s[7] - p[7] / 8.0).abs() < 1e-12);
    }

    /// transformers 5 writes `rope_parameters` instead of `rope_theta` and `rope_scaling`
    /// (SmolLM2's HF directory made by it has theta 100000 only there).
    #[test]
    fn transformers_5_rope_parameters_are_read() {
        let c = hf(serde_json::json!({"rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}}))
            .unwrap();
        assert_eq!((c.rope_theta, c.rope_scaling.is_none()), (100000.0, true));
        let c = hf(
            serde_json::json!({"rope_parameters": {"rope_type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192, "rope_theta": 500000.0}}),
        )
        .unwrap();
        assert_eq!(c.rope_theta, 500000.0);
        assert!(c.rope_scaling.is_some());
        // Without either, Llama's default; parameters without a theta are not guessed at.
        assert_eq!(hf(serde_json::json!({})).unwrap().rope_theta, 10000.0);
        let per_layer =
            serde_json::json!({"rope_parameters": {"full_attention": {"rope_theta": 1e6}}});
        assert!(hf(per_layer).unwrap_err().contains("rope_theta"));
    }
}
