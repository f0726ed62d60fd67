//! Safetensors checkpoints, memory-mapped: one `model.safetensors`, or shards listed by
//! `model.safetensors.index.json`.
//!
//! Tensors are read straight out of the mapping and converted once, at load, to the element
//! type a backend keeps ([`DType`]); nothing is read from disk twice and nothing but the
//! converted weights stays in memory once loading ends.

#![allow(unsafe_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use half::slice::HalfFloatSliceExt;
use half::vec::HalfFloatVecExt;
use half::{bf16, f16};
use safetensors::{Dtype, SafeTensors};

pub use dyn_model::le_vec;

use super::ModelError;
use crate::quant::QTensor;

/// Element types the engine keeps weights in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    F16,
    Bf16,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::Bf16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
        }
    }

    /// From a `torch_dtype` string (`float32`, `bfloat16`, ...).
    pub fn from_torch(s: &str) -> Option<DType> {
        match s {
            "float32" | "float" | "f32" => Some(DType::F32),
            "float16" | "half" | "f16" => Some(DType::F16),
            "bfloat16" | "bf16" => Some(DType::Bf16),
            _ => None,
        }
    }
}

/// A tensor's elements in one of the kept types.
#[derive(Debug, Clone)]
pub enum Host {
    F32(Vec<f32>),
    F16(Vec<f16>),
    Bf16(Vec<bf16>),
    /// A matrix in GGML's quantized blocks (from a GGUF file), multiplied as it is on CPU.
    Quant(QTensor),
}

impl Host {
    pub fn len(&self) -> usize {
        match self {
            Host::F32(v) => v.len(),
            Host::F16(v) => v.len(),
            Host::Bf16(v) => v.len(),
            Host::Quant(q) => q.rows * q.cols,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The element type, for dense tensors (`None`: quantized).
    pub fn dtype(&self) -> Option<DType> {
        match self {
            Host::F32(_) => Some(DType::F32),
            Host::F16(_) => Some(DType::F16),
            Host::Bf16(_) => Some(DType::Bf16),
            Host::Quant(_) => None,
        }
    }

    /// Bytes it takes.
    pub fn bytes(&self) -> usize {
        match self {
            Host::Quant(q) => q.bytes(),
            dense => dense.len() * dense.dtype().map_or(4, DType::size),
        }
    }

    /// Every element as f32.
    pub fn to_f32(&self) -> Vec<f32> {
        match self {
            Host::F32(v) => v.clone(),
            Host::F16(v) => v.to_f32_vec(),
            Host::Bf16(v) => v.to_f32_vec(),
            Host::Quant(q) => q.to_f32(),
        }
    }

    /// Converted to the dense `dtype` (quantized matrices widened).
    pub fn to(self, dtype: DType) -> Host {
        match (self, dtype) {
            (Host::F32(v), DType::F32) => Host::F32(v),
            (Host::F16(v), DType::F16) => Host::F16(v),
            (Host::Bf16(v), DType::Bf16) => Host::Bf16(v),
            (other, DType::F32) => Host::F32(other.to_f32()),
            (other, DType::F16) => Host::F16(Vec::from_f32_slice(&other.to_f32())),
            (other, DType::Bf16) => Host::Bf16(Vec::from_f32_slice(&other.to_f32())),
        }
    }

    /// Rows (`cols` elements each) in `order`; `None` gives a row of zeros.
    ///
    /// # Panics
    /// When `order` names a row the tensor does not have.
    pub fn select_rows(&self, order: &[Option<usize>], cols: usize) -> Host {
        fn pick<T: Copy>(v: &[T], order: &[Option<usize>], cols: usize, zero: T) -> Vec<T> {
            let mut out = Vec::with_capacity(order.len() * cols);
            for r in order {
                match r {
                    Some(r) => out.extend_from_slice(&v[r * cols..(r + 1) * cols]),
                    None => out.resize(out.len() + cols, zero),
                }
            }
            out
        }
        match self {
            Host::F32(v) => Host::F32(pick(v, order, cols, 0.0)),
            Host::F16(v) => Host::F16(pick(v, order, cols, f16::ZERO)),
            Host::Bf16(v) => Host::Bf16(pick(v, order, cols, bf16::ZERO)),
            Host::Quant(q) => Host::Quant(q.select_rows(order)),
        }
    }

    /// Row `r` of a `[_, cols]` matrix into `out` as f32.
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        let cols = out.len();
        let at = r * cols..(r + 1) * cols;
        match self {
            Host::F32(e) => out.copy_from_slice(&e[at]),
            Host::Bf16(e) => out
                .iter_mut()
                .zip(&e[at])
                .for_each(|(o, v)| *o = v.to_f32()),
            Host::F16(e) => out
                .iter_mut()
                .zip(&e[at])
                .for_each(|(o, v)| *o = v.to_f32()),
            Host::Quant(q) => q.dequantize_row(r, out),
        }
    }
}

/// An open checkpoint: its files mapped, and which file holds each tensor.
pub struct Checkpoint {
    maps: Vec<(PathBuf, memmap2::Mmap)>,
    index: HashMap<String, usize>,
}

impl Checkpoint {
    pub fn open(dir: &Path) -> Result<Self, ModelError> {
        let single = dir.join("model.safetensors");
        let sharded = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if sharded.exists() {
            let text =
                std::fs::read_to_string(&sharded).map_err(|e| ModelError::io(&sharded, e))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| ModelError::Weights(format!("{}: {e}", sharded.display())))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| {
                    ModelError::Weights(format!("{}: no weight_map object", sharded.display()))
                })?;
            let mut files: Vec<PathBuf> = Vec::new();
            for f in map.values() {
                let name = f.as_str().ok_or_else(|| {
                    ModelError::Weights(format!(
                        "{}: a weight_map value is not a file name",
                        sharded.display()
                    ))
                })?;
                // Shard names come from a file: keep them inside the model directory.
                if name.contains('/') || name.contains('\\') || name.starts_with('.') {
                    return Err(ModelError::Weights(format!(
                        "{}: shard name {name:?} leaves the model directory",
                        sharded.display()
                    )));
                }
                let p = dir.join(name);
                if !files.contains(&p) {
                    files.push(p);
                }
            }
            files
        } else if single.exists() {
            vec![single]
        } else {
            return Err(ModelError::Weights(format!(
                "{} has neither model.safetensors nor model.safetensors.index.json",
                dir.display()
            )));
        };
        let mut maps = Vec::new();
        let mut index = HashMap::new();
        for path in files {
            let file = std::fs::File::open(&path).map_err(|e| ModelError::io(&path, e))?;
            // SAFETY: the mapping is read-only and lives as long as `self`; model files are
            // not modified while a server runs (the same contract as Hugging Face's loaders).
            let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| ModelError::io(&path, e))?;
            let st = SafeTensors::deserialize(&map)
                .map_err(|e| ModelError::Weights(format!("{}: {e}", path.display())))?;
            for name in st.names() {
                index.insert(name.to_string(), maps.len());
            }
            maps.push((path, map));
        }
        Ok(Checkpoint { maps, index })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// Tensor `name`, checked to have `shape`, converted to `want`.
    pub fn get(&self, name: &str, shape: &[usize], want: DType) -> Result<Host, ModelError> {
        let &file = self
            .index
            .get(name)
            .ok_or_else(|| ModelError::Weights(format!("tensor {name} is missing")))?;
        let (path, map) = &self.maps[file];
        let st = SafeTensors::deserialize(map)
            .map_err(|e| ModelError::Weights(format!("{}: {e}", path.display())))?;
        let t = st
            .tensor(name)
            .map_err(|e| ModelError::Weights(format!("{}: {name}: {e}", path.display())))?;
        if t.shape() != shape {
            return Err(ModelError::Weights(format!(
                "tensor {name} has shape {:?}, the config implies {shape:?}",
                t.shape()
            )));
        }
        let data = t.data();
        let host = match t.dtype() {
            Dtype::F32 => Host::F32(le_vec(data)),
            Dtype::BF16 => Host::Bf16(le_vec(data)),
            Dtype::F16 => Host::F16(le_vec(data)),
            other => {
                return Err(ModelError::Weights(format!(
                    "tensor {name} is {other:?}; supported: F32, F16, BF16"
                )));
            }
        };
        Ok(host.to(want))
    }

    /// Tensor `name` as f32 (norms, biases, embeddings).
    pub fn get_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        match self.get(name, shape, DType::F32)? {
            Host::F32(v) => Ok(v),
            other => Ok(other.to_f32()),
        }
    }
}
