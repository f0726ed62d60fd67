//! GGUF files (llama.cpp's model format), memory-mapped: the header, the metadata
//! key-values, and the tensor table, every length and offset checked against the file before
//! anything is read, so a truncated or corrupt file is an error naming the file and what was
//! wrong, never a panic or a huge allocation.
//!
//! [`Gguf::config`] turns the `llama.*` / `qwen2.*` metadata into the shape the engine runs
//! (through the same checks as `config.json`); [`Gguf::matrix`] hands out a tensor's bytes,
//! checked against the shape the metadata implies, with its [`TensorType`]: `dyn-compute`
//! reads the weights through it, quantized matrices either kept as they are or widened.
//! [`Gguf::tensor_f32`] widens a small tensor here (a LoRA file's). Tokenizer and chat
//! template metadata are read by the serving side (`dyn-llm`) through [`Gguf::meta`].

#![allow(unsafe_code)]

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use half::slice::HalfFloatSliceExt;

use super::ModelError;
use super::config::{HfConfig, ModelConfig};
use super::le_vec;

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

/// GGML's block-quantized types that dyn reads: blocks of 32 (Q4_0, Q4_1, Q8_0) or 256 (the
/// K-quants) values that share scales. `dyn-compute` multiplies them without widening (its
/// `quant` module knows how each block unpacks, and checks these sizes against it); here they
/// size a tensor's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum QType {
    Q4_0,
    Q4_1,
    Q8_0,
    Q4K,
    Q5K,
    Q6K,
}

impl QType {
    /// From ggml's `ggml_type` number, as GGUF stores it.
    pub fn from_ggml(id: u32) -> Option<QType> {
        Some(match id {
            2 => QType::Q4_0,
            3 => QType::Q4_1,
            8 => QType::Q8_0,
            12 => QType::Q4K,
            13 => QType::Q5K,
            14 => QType::Q6K,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            QType::Q4_0 => "Q4_0",
            QType::Q4_1 => "Q4_1",
            QType::Q8_0 => "Q8_0",
            QType::Q4K => "Q4_K",
            QType::Q5K => "Q5_K",
            QType::Q6K => "Q6_K",
        }
    }

    /// Values per block.
    pub fn block(self) -> usize {
        match self {
            QType::Q4_0 | QType::Q4_1 | QType::Q8_0 => 32,
            QType::Q4K | QType::Q5K | QType::Q6K => 256,
        }
    }

    /// Bytes per block (`ggml-common.h`'s block structs).
    pub fn block_bytes(self) -> usize {
        match self {
            QType::Q4_0 => 18,
            QType::Q4_1 => 20,
            QType::Q8_0 => 34,
            QType::Q4K => 144,
            QType::Q5K => 176,
            QType::Q6K => 210,
        }
    }

    /// Bytes of a row of `cols` values, if they are whole blocks.
    pub fn row_bytes(self, cols: usize) -> Option<usize> {
        cols.is_multiple_of(self.block())
            .then(|| cols / self.block() * self.block_bytes())
    }
}

/// The element types a tensor may have here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorType {
    F32,
    F16,
    Bf16,
    Quant(QType),
}

impl TensorType {
    /// From ggml's `ggml_type` number, as GGUF stores it.
    pub fn from_ggml(id: u32) -> Option<TensorType> {
        match id {
            0 => Some(TensorType::F32),
            1 => Some(TensorType::F16),
            30 => Some(TensorType::Bf16),
            _ => QType::from_ggml(id).map(TensorType::Quant),
        }
    }

    /// ggml's name (`F32`, `BF16`, `Q4_K`, ...).
    pub fn name(self) -> &'static str {
        match self {
            TensorType::F32 => "F32",
            TensorType::F16 => "F16",
            TensorType::Bf16 => "BF16",
            TensorType::Quant(q) => q.name(),
        }
    }

    /// Bytes of a row of `cols` values, if they are whole blocks.
    pub fn row_bytes(self, cols: usize) -> Option<usize> {
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

/// A tensor of the file: its entry in the table and its bytes.
#[derive(Debug, Clone, Copy)]
pub struct Tensor<'a> {
    /// ggml's order: `dims[0]` is the innermost (a matrix's columns).
    pub dims: &'a [usize],
    pub ty: TensorType,
    /// Whole rows of `ty`, checked against the file's length when it was opened.
    pub data: &'a [u8],
}

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

    /// An error about this file: its name, then `what`.
    pub fn err(&self, what: impl std::fmt::Display) -> ModelError {
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

    /// Tensor `name`: its entry and its bytes.
    pub fn tensor(&self, name: &str) -> Result<Tensor<'_>, ModelError> {
        let t = self
            .tensors
            .get(name)
            .ok_or_else(|| self.err(format!("tensor {name} is missing")))?;
        Ok(Tensor {
            dims: &t.dims,
            ty: t.ty,
            data: &self.map[t.start..t.start + t.len],
        })
    }

    /// Whether the file has a tensor `name`.
    pub fn has_tensor(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Tensor `name`, checked to be a `[rows, cols]` matrix (a vector when `rows` is 1).
    pub fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Tensor<'_>, ModelError> {
        let t = self.tensor(name)?;
        let shape_ok = match t.dims {
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
        Ok(t)
    }

    /// The names of its tensors.
    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// Tensor `name`'s dims (ggml's order: `dims[0]` innermost) and its values as f32: a LoRA
    /// file's small tensors, in F32, F16, BF16 or Q8_0 (what llama.cpp's converter writes).
    pub fn tensor_f32(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>), ModelError> {
        let t = self.tensor(name)?;
        let values = match t.ty {
            TensorType::F32 => le_vec(t.data),
            TensorType::F16 => le_vec::<half::f16>(t.data).to_f32_vec(),
            TensorType::Bf16 => le_vec::<half::bf16>(t.data).to_f32_vec(),
            TensorType::Quant(QType::Q8_0) => q8_0_f32(t.data),
            other => {
                return Err(self.err(format!(
                    "tensor {name} is {}; read here in F32, F16, BF16 or Q8_0",
                    other.name()
                )));
            }
        };
        Ok((t.dims.to_vec(), values))
    }
}

/// Q8_0's blocks `{f16 d; i8 q[32]}` widened: each value is `d · q`.
fn q8_0_f32(data: &[u8]) -> Vec<f32> {
    data.chunks_exact(QType::Q8_0.block_bytes())
        .flat_map(|b| {
            let d = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
            b[2..].iter().map(move |q| d * f32::from(*q as i8))
        })
        .collect()
}

/// The row order that undoes llama.cpp's q/k permutation for `heads` heads of `d` rows: within
/// each head, GGUF row `2j + i` is row `i · d/2 + j` of the original, so row `n` of the
/// original is row `order[n]` of the file.
pub fn rotary_order(heads: usize, d: usize) -> Vec<usize> {
    (0..heads)
        .flat_map(|h| (0..2).flat_map(move |i| (0..d / 2).map(move |j| h * d + 2 * j + i)))
        .collect()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_types_are_read_from_ggml_numbers() {
        assert_eq!(TensorType::from_ggml(30), Some(TensorType::Bf16));
        assert_eq!(
            TensorType::from_ggml(12),
            Some(TensorType::Quant(QType::Q4K))
        );
        assert_eq!(QType::Q4K.name(), "Q4_K");
        // Q2_K: a type dyn does not read.
        assert_eq!(TensorType::from_ggml(10), None);
        assert_eq!(ggml_type_name(10), "Q2_K");
        assert_eq!(QType::Q6K.row_bytes(512), Some(420));
        assert_eq!(TensorType::F16.row_bytes(3), Some(6));
        assert_eq!(QType::Q8_0.row_bytes(48), None);
    }

    #[test]
    fn q8_0_blocks_widen_to_their_scale_times_each_value() {
        let mut block = half::f16::from_f32(0.5).to_le_bytes().to_vec();
        block.extend((0..32).map(|i: i8| (i - 16) as u8));
        let v = q8_0_f32(&block);
        assert_eq!(v.len(), 32);
        assert_eq!((v[0], v[16], v[31]), (-8.0, 0.0, 7.5));
    }
}
