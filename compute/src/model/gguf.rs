//! GGUF files (llama.cpp's model format), memory-mapped: the header, the metadata
//! key-values, and the tensor table, every length and offset checked against the file before
//! anything is read, so a truncated or corrupt file is an error naming the file and what was
//! wrong, never a panic or a huge allocation.
//!
//! [`Gguf::config`] turns the `llama.*` / `qwen2.*` metadata into the shape the engine runs
//! (through the same checks as `config.json`); [`Gguf::weights`] reads the tensors by their
//! GGUF names into [`ModelWeights`], quantized matrices either kept as they are (the CPU
//! backend multiplies them directly) or widened to a dtype. Tokenizer and chat template
//! metadata are read by the serving side (`dyn-llm`) through [`Gguf::meta`].

#![allow(unsafe_code)]

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use super::config::{HfConfig, ModelConfig};
use super::weights::{DType, Host, le_vec};
use super::{LayerParts, LayerWeights, ModelError, ModelWeights};
use crate::quant::{QTensor, QType};

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    Str(String),
    Array(Vec<Value>),
}

impl Value {
    /// Any integer that is not negative.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::I8(v) => Some(v.into()),
            Value::I16(v) => Some(v.into()),
            Value::I32(v) => Some(v.into()),
            Value::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// The element types a tensor may have here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TensorType {
    F32,
    F16,
    Bf16,
    Quant(QType),
}

impl TensorType {
    fn from_ggml(id: u32) -> Option<TensorType> {
        match id {
            0 => Some(TensorType::F32),
            1 => Some(TensorType::F16),
            30 => Some(TensorType::Bf16),
            _ => QType::from_ggml(id).map(TensorType::Quant),
        }
    }

    fn name(self) -> &'static str {
        match self {
            TensorType::F32 => "F32",
            TensorType::F16 => "F16",
            TensorType::Bf16 => "BF16",
            TensorType::Quant(q) => q.name(),
        }
    }

    /// Bytes of a row of `cols` values, if they are whole blocks.
    fn row_bytes(self, cols: usize) -> Option<usize> {
        match self {
            TensorType::F32 => cols.checked_mul(4),
            TensorType::F16 | TensorType::Bf16 => cols.checked_mul(2),
            TensorType::Quant(q) => q.row_bytes(cols),
        }
    }
}

/// ggml's name for a type number, for errors about types this engine does not read.
fn ggml_type_name(id: u32) -> &'static str {
    const NAMES: [&str; 40] = [
        "F32",
        "F16",
        "Q4_0",
        "Q4_1",
        "Q4_2",
        "Q4_3",
        "Q5_0",
        "Q5_1",
        "Q8_0",
        "Q8_1",
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
        "Q8_K",
        "IQ2_XXS",
        "IQ2_XS",
        "IQ3_XXS",
        "IQ1_S",
        "IQ4_NL",
        "IQ3_S",
        "IQ2_S",
        "IQ4_XS",
        "I8",
        "I16",
        "I32",
        "I64",
        "F64",
        "IQ1_M",
        "BF16",
        "Q4_0_4_4",
        "Q4_0_4_8",
        "Q4_0_8_8",
        "TQ1_0",
        "TQ2_0",
        "IQ4_NL_4_4",
        "IQ4_NL_4_8",
        "IQ4_NL_8_8",
        "MXFP4",
    ];
    NAMES.get(id as usize).copied().unwrap_or("unknown")
}

const SUPPORTED: &str = "F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K";

/// One tensor's entry in the table.
#[derive(Debug, Clone)]
struct TensorInfo {
    /// ggml's order: `dims[0]` is the innermost (a matrix's columns).
    dims: Vec<usize>,
    ty: TensorType,
    /// Byte range in the file.
    start: usize,
    len: usize,
}

/// An open GGUF file.
pub struct Gguf {
    pub path: PathBuf,
    map: memmap2::Mmap,
    /// Every metadata key-value.
    pub meta: BTreeMap<String, Value>,
    tensors: HashMap<String, TensorInfo>,
}

impl std::fmt::Debug for Gguf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gguf")
            .field("path", &self.path)
            .field("tensors", &self.tensors.len())
            .finish_non_exhaustive()
    }
}

/// Whether `path` names a GGUF file (by its extension).
pub fn is_gguf(path: &Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

/// A bounds-checked reader over the mapped bytes.
struct Cursor<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], String> {
        let end = self
            .at
            .checked_add(n)
            .filter(|e| *e <= self.b.len())
            .ok_or_else(|| format!("truncated: {what} at byte {} runs past the end", self.at))?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], String> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N, what)?);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A count of items at least `min_size` bytes each: checked against what is left, so a
    /// corrupt count cannot ask for a huge allocation.
    fn count(&mut self, min_size: usize, what: &str) -> Result<usize, String> {
        let n = self.u64(what)?;
        let left = (self.b.len() - self.at) as u64;
        if n.saturating_mul(min_size as u64) > left {
            return Err(format!(
                "{what} says {n}, more than the {left} bytes left in the file"
            ));
        }
        Ok(n as usize)
    }

    fn string(&mut self, what: &str) -> Result<String, String> {
        let n = self.count(1, what)?;
        let b = self.take(n, what)?;
        String::from_utf8(b.to_vec()).map_err(|_| format!("{what} is not UTF-8"))
    }

    fn value(&mut self, ty: u32, key: &str, depth: usize) -> Result<Value, String> {
        Ok(match ty {
            0 => Value::U8(self.array::<1>(key)?[0]),
            1 => Value::I8(self.array::<1>(key)?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.array(key)?)),
            3 => Value::I16(i16::from_le_bytes(self.array(key)?)),
            4 => Value::U32(self.u32(key)?),
            5 => Value::I32(i32::from_le_bytes(self.array(key)?)),
            6 => Value::F32(f32::from_le_bytes(self.array(key)?)),
            7 => Value::Bool(self.array::<1>(key)?[0] != 0),
            8 => Value::Str(self.string(key)?),
            9 if depth == 0 => {
                let ety = self.u32(key)?;
                let n = self.count(1, key)?;
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.value(ety, key, depth + 1)?);
                }
                Value::Array(v)
            }
            9 => return Err(format!("metadata {key}: nested arrays are not supported")),
            10 => Value::U64(self.u64(key)?),
            11 => Value::I64(i64::from_le_bytes(self.array(key)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(key)?)),
            other => return Err(format!("metadata {key}: unknown value type {other}")),
        })
    }
}

impl Gguf {
    /// Map and parse `path`.
    pub fn open(path: &Path) -> Result<Gguf, ModelError> {
        let file = std::fs::File::open(path).map_err(|e| ModelError::io(path, e))?;
        // SAFETY: the mapping is read-only and lives as long as `self`; model files are not
        // modified while a server runs (llama.cpp maps them under the same contract).
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| ModelError::io(path, e))?;
        let (meta, tensors) =
            parse(&map).map_err(|e| ModelError::Weights(format!("{}: {e}", path.display())))?;
        Ok(Gguf {
            path: path.to_owned(),
            map,
            meta,
            tensors,
        })
    }

    /// Read and parse `file`, opened from `path` and checked by
    /// [`super::files::open_regular`] (a regular file, `len` bytes within its bound): a copy
    /// of the descriptor that was checked. For files a caller names at run time (LoRA
    /// adapters): unlike a mapping, a copy cannot fault the process when the file is truncated
    /// on disk afterwards.
    pub fn read_checked(
        path: &Path,
        mut file: std::fs::File,
        len: u64,
    ) -> Result<Gguf, ModelError> {
        use std::io::Read as _;
        let shown = super::files::shown(path);
        let len = usize::try_from(len)
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| ModelError::Weights(format!("{shown}: empty, not a GGUF file")))?;
        let mut map = memmap2::MmapMut::map_anon(len).map_err(|e| ModelError::io(path, e))?;
        file.read_exact(&mut map)
            .map_err(|e| ModelError::io(path, e))?;
        let map = map.make_read_only().map_err(|e| ModelError::io(path, e))?;
        let (meta, tensors) =
            parse(&map).map_err(|e| ModelError::Weights(format!("{shown}: {e}")))?;
        Ok(Gguf {
            path: path.to_owned(),
            map,
            meta,
            tensors,
        })
    }

    /// Metadata alone, no tensors: a vocabulary or template to try without writing a file.
    pub fn from_meta(meta: BTreeMap<String, Value>) -> Result<Gguf, ModelError> {
        let map = memmap2::MmapMut::map_anon(1)
            .and_then(memmap2::MmapMut::make_read_only)
            .map_err(|e| ModelError::Weights(format!("an empty mapping: {e}")))?;
        Ok(Gguf {
            path: PathBuf::from("<metadata>"),
            map,
            meta,
            tensors: HashMap::new(),
        })
    }

    fn err(&self, what: impl std::fmt::Display) -> ModelError {
        ModelError::Weights(format!("{}: {what}", super::files::shown(&self.path)))
    }

    /// The metadata value `key`.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.meta.get(key)
    }

    /// `general.architecture`.
    pub fn architecture(&self) -> Result<&str, ModelError> {
        self.get("general.architecture")
            .and_then(Value::as_str)
            .ok_or_else(|| self.err("metadata general.architecture is missing"))
    }

    /// The model's shape, from `{arch}.*` metadata and the tensor table.
    pub fn config(&self) -> Result<ModelConfig, ModelError> {
        let arch = self.architecture()?.to_owned();
        if !matches!(arch.as_str(), "llama" | "qwen2" | "mistral") {
            return Err(self.err(format!(
                "general.architecture {arch:?} is not supported (llama, qwen2, mistral)"
            )));
        }
        let key = |k: &str| format!("{arch}.{k}");
        let int = |k: &str| -> Result<Option<usize>, ModelError> {
            match self.get(&key(k)) {
                None => Ok(None),
                Some(v) => v
                    .as_u64()
                    .and_then(|v| usize::try_from(v).ok())
                    .map(Some)
                    .ok_or_else(|| self.err(format!("metadata {} is not a count", key(k)))),
            }
        };
        let need = |k: &str| -> Result<usize, ModelError> {
            int(k)?.ok_or_else(|| self.err(format!("metadata {} is missing", key(k))))
        };
        let float = |k: &str| -> Result<Option<f32>, ModelError> {
            match self.get(&key(k)) {
                None => Ok(None),
                Some(v) => v
                    .as_f64()
                    .map(|v| Some(v as f32))
                    .ok_or_else(|| self.err(format!("metadata {} is not a number", key(k)))),
            }
        };
        if self
            .get(&key("rope.scaling.type"))
            .and_then(Value::as_str)
            .is_some_and(|t| t != "none")
            || self.tensors.contains_key("rope_freqs.weight")
        {
            return Err(self.err(
                "rope scaling (rope.scaling.type, rope_freqs.weight) is not supported for GGUF",
            ));
        }
        if self.get(&key("expert_count")).is_some() {
            return Err(self.err("mixture-of-experts models are not supported"));
        }
        let heads = need("attention.head_count")?;
        let hidden = need("embedding_length")?;
        let vocab = match int("vocab_size")? {
            Some(v) => v,
            None => self
                .get("tokenizer.ggml.tokens")
                .and_then(Value::as_array)
                .map(<[Value]>::len)
                .ok_or_else(|| {
                    self.err(format!(
                        "neither {} nor tokenizer.ggml.tokens gives the vocabulary size",
                        key("vocab_size")
                    ))
                })?,
        };
        let head_dim = int("attention.key_length")?;
        if let (Some(k), Some(v)) = (head_dim, int("attention.value_length")?)
            && k != v
        {
            return Err(self.err(format!(
                "attention.key_length {k} differs from attention.value_length {v}"
            )));
        }
        let hf = HfConfig {
            model_type: Some(arch.clone()),
            architectures: Vec::new(),
            hidden_size: hidden,
            intermediate_size: need("feed_forward_length")?,
            num_hidden_layers: need("block_count")?,
            num_attention_heads: heads,
            num_key_value_heads: int("attention.head_count_kv")?,
            head_dim,
            vocab_size: vocab,
            rms_norm_eps: float("attention.layer_norm_rms_epsilon")?.unwrap_or(1e-5),
            rope_theta: Some(float("rope.freq_base")?.unwrap_or(10000.0)),
            rope_scaling: None,
            rope_parameters: None,
            tie_word_embeddings: !self.tensors.contains_key("output.weight"),
            attention_bias: Some(self.tensors.contains_key("blk.0.attn_q.bias")),
            sliding_window: int("attention.sliding_window")?,
            use_sliding_window: None,
            max_position_embeddings: int("context_length")?.unwrap_or(2048),
            torch_dtype: None,
            hidden_act: None,
        };
        let c = ModelConfig::from_hf(&hf).map_err(|e| self.err(e))?;
        if let Some(rot) = int("rope.dimension_count")?
            && rot != c.head_dim
        {
            return Err(self.err(format!(
                "partial rotary embeddings (rope.dimension_count {rot} of head size {}) are not supported",
                c.head_dim
            )));
        }
        Ok(c)
    }

    /// Tensor `name` as a `[rows, cols]` matrix (a vector when `rows` is 1): checked against
    /// its table entry, then kept quantized (`keep`), or converted to `dtype`.
    fn matrix(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
        dtype: DType,
        keep: bool,
    ) -> Result<Host, ModelError> {
        let t = self
            .tensors
            .get(name)
            .ok_or_else(|| self.err(format!("tensor {name} is missing")))?;
        let shape_ok = match t.dims.as_slice() {
            [c] => rows == 1 && *c == cols,
            [c, r, rest @ ..] => *c == cols && *r == rows && rest.iter().all(|d| *d == 1),
            _ => false,
        };
        if !shape_ok {
            return Err(self.err(format!(
                "tensor {name} has dims {:?}, the metadata implies [{cols}, {rows}]",
                t.dims
            )));
        }
        let data = &self.map[t.start..t.start + t.len];
        Ok(match (t.ty, dtype) {
            (TensorType::Quant(q), _) => {
                let qt = QTensor::new(q, rows, cols, data.to_vec())
                    .map_err(|e| self.err(format!("tensor {name}: {e}")))?;
                if keep {
                    Host::Quant(qt)
                } else {
                    Host::F32(qt.to_f32()).to(dtype)
                }
            }
            (TensorType::F32, _) => Host::F32(le_vec(data)).to(dtype),
            (TensorType::F16, _) => Host::F16(le_vec(data)).to(dtype),
            (TensorType::Bf16, _) => Host::Bf16(le_vec(data)).to(dtype),
        })
    }

    /// The names of its tensors.
    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// Tensor `name`'s dims (ggml's order: `dims[0]` innermost) and its values as f32,
    /// whatever its type (a LoRA file's small tensors: F32, F16, BF16 or Q8_0).
    pub fn tensor_f32(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>), ModelError> {
        let t = self
            .tensors
            .get(name)
            .ok_or_else(|| self.err(format!("tensor {name} is missing")))?;
        let cols = t.dims.first().copied().unwrap_or(1);
        let rows = t.dims.iter().skip(1).product::<usize>();
        let m = self.matrix(name, rows, cols, DType::F32, false)?;
        Ok((t.dims.clone(), m.to_f32()))
    }

    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, ModelError> {
        Ok(self.matrix(name, 1, len, DType::F32, false)?.to_f32())
    }

    /// Every weight, by GGUF's tensor names. Quantized matrices stay quantized when
    /// `keep_quantized`, otherwise everything is converted to `dtype`; vectors are f32.
    pub fn weights(
        &self,
        config: ModelConfig,
        dtype: DType,
        keep_quantized: bool,
    ) -> Result<ModelWeights, ModelError> {
        let c = &config;
        let (h, d) = (c.hidden, c.head_dim);
        let (qd, kvd) = (c.heads * d, c.kv_heads * d);
        let get =
            |n: &str, rows: usize, cols: usize| self.matrix(n, rows, cols, dtype, keep_quantized);
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
                let mut b = self.vector(&p("attn_q.bias"), qd)?;
                b.extend(self.vector(&p("attn_k.bias"), kvd)?);
                b.extend(self.vector(&p("attn_v.bias"), kvd)?);
                Some(b)
            } else {
                None
            };
            let parts = LayerParts {
                attn_norm: self.vector(&p("attn_norm.weight"), h)?,
                q,
                k,
                v: get(&p("attn_v.weight"), kvd, h)?,
                qkv_bias,
                o: get(&p("attn_output.weight"), h, qd)?,
                mlp_norm: self.vector(&p("ffn_norm.weight"), h)?,
                gate: get(&p("ffn_gate.weight"), c.intermediate, h)?,
                up: get(&p("ffn_up.weight"), c.intermediate, h)?,
                down: get(&p("ffn_down.weight"), h, c.intermediate)?,
            };
            layers.push(LayerWeights::fuse(c, parts));
        }
        let lm_head = self
            .tensors
            .contains_key("output.weight")
            .then(|| get("output.weight", c.vocab, h))
            .transpose()?;
        let norm = self.vector("output_norm.weight", h)?;
        Ok(ModelWeights::assemble(
            config, dtype, embed, layers, norm, lm_head,
        ))
    }
}

/// The row order that undoes llama.cpp's q/k permutation for `heads` heads of `d` rows (see
/// [`rotary_halves`]): row `n` of the original is row `order[n]` of the file.
pub fn rotary_order(heads: usize, d: usize) -> Vec<usize> {
    (0..heads)
        .flat_map(|h| (0..2).flat_map(move |i| (0..d / 2).map(move |j| h * d + 2 * j + i)))
        .collect()
}

/// Undo llama.cpp's q/k row permutation: within each head of `d` rows, GGUF row `2j + i`
/// is row `i · d/2 + j` of the original.
fn rotary_halves(m: Host, heads: usize, d: usize) -> Host {
    let order: Vec<Option<usize>> = rotary_order(heads, d).into_iter().map(Some).collect();
    m.select_rows(&order, m.len() / order.len().max(1))
}

/// The metadata and the tensor table.
type Parsed = (BTreeMap<String, Value>, HashMap<String, TensorInfo>);

fn parse(b: &[u8]) -> Result<Parsed, String> {
    let mut c = Cursor { b, at: 0 };
    if c.take(4, "magic").ok() != Some(b"GGUF".as_slice()) {
        return Err("not a GGUF file (no GGUF magic at the start)".into());
    }
    let version = c.u32("version")?;
    if !(2..=3).contains(&version) {
        return Err(format!("GGUF version {version} is not supported (2, 3)"));
    }
    // A tensor entry takes at least 8 + 4 + 4 + 8 bytes, a key-value 8 + 4 + 1.
    let n_tensors = c.count(24, "tensor count")?;
    let n_kv = c.count(13, "metadata count")?;
    let mut meta = BTreeMap::new();
    for _ in 0..n_kv {
        let key = c.string("metadata key")?;
        let ty = c.u32(&key)?;
        let v = c.value(ty, &key, 0)?;
        meta.insert(key, v);
    }
    let align = match meta.get("general.alignment") {
        None => 32,
        Some(v) => v
            .as_u64()
            .and_then(|a| usize::try_from(a).ok())
            .filter(|a| a.is_power_of_two())
            .ok_or("general.alignment is not a power of two")?,
    };
    let mut entries = Vec::with_capacity(n_tensors);
    for _ in 0..n_tensors {
        let name = c.string("tensor name")?;
        let n_dims = c.u32(&name)?;
        if !(1..=4).contains(&n_dims) {
            return Err(format!(
                "tensor {name}: {n_dims} dimensions (1 to 4 allowed)"
            ));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            let d = c.u64(&name)?;
            dims.push(usize::try_from(d).map_err(|_| format!("tensor {name}: dimension {d}"))?);
        }
        let id = c.u32(&name)?;
        let ty = TensorType::from_ggml(id).ok_or_else(|| {
            format!(
                "tensor {name} has type {} ({id}), which dyn does not read (supported: {SUPPORTED})",
                ggml_type_name(id)
            )
        })?;
        let offset = c.u64(&name)?;
        entries.push((name, dims, ty, offset));
    }
    let data_start = c.at.div_ceil(align) * align;
    let mut tensors = HashMap::with_capacity(entries.len());
    for (name, dims, ty, offset) in entries {
        let rows = dims[1..]
            .iter()
            .try_fold(1usize, |a, d| a.checked_mul(*d))
            .ok_or_else(|| format!("tensor {name}: dimensions {dims:?} overflow"))?;
        let len = ty
            .row_bytes(dims[0])
            .and_then(|r| r.checked_mul(rows))
            .ok_or_else(|| {
                format!(
                    "tensor {name}: rows of {} values are not whole {} blocks",
                    dims[0],
                    ty.name()
                )
            })?;
        let start = usize::try_from(offset)
            .ok()
            .and_then(|o| o.checked_add(data_start))
            .filter(|s| s.checked_add(len).is_some_and(|e| e <= b.len()))
            .ok_or_else(|| {
                format!(
                    "truncated: tensor {name} ({} bytes at offset {offset}) runs past the end of the file",
                    len
                )
            })?;
        tensors.insert(
            name,
            TensorInfo {
                dims,
                ty,
                start,
                len,
            },
        );
    }
    Ok((meta, tensors))
}
