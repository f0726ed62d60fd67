//! LoRA adapters: low-rank additions `y += scale · B · (A · x)` to a layer's projections,
//! read from PEFT's files (`adapter_config.json` + `adapter_model.safetensors`, what
//! `save_pretrained` writes and what vLLM's `--lora-modules` and `load_lora_adapter` take) or
//! from a GGUF LoRA file (what llama.cpp's `convert_lora_to_gguf.py` writes and `llama-server
//! --lora` takes): [`LoraAdapter::load`] tells them apart.
//!
//! The base weights are never touched: a backend adds each sequence's own adapter to the
//! products of the base (quantized or not), so sequences with different adapters, and none,
//! share one batch (the Punica / S-LoRA way). An adapter is kept in f32 with its scale folded
//! into `B`, both matrices stored transposed (`Aᵀ` `[in, rank]`, `Bᵀ` `[rank, out]`): the
//! right-hand sides of the two small matrix products that apply it to a group of rows.
//!
//! What is read, and refused with the reason: `peft_type` LORA; `r`, `lora_alpha`,
//! `use_rslora` (`alpha / √r`), `rank_pattern` and `alpha_pattern` keyed by module names
//! (plain names, matched at the end of the module's path as PEFT does; not regular
//! expressions); DoRA, `fan_in_fan_out`, trained biases and `modules_to_save` are refused, as
//! are tensors for anything but the seven projections of the decoder layers. Each tensor's
//! shape is checked against the base model's, so an adapter of another model is refused
//! before it is used, naming the first tensor that does not fit.
//!
//! GGUF: `general.type` `adapter`, `adapter.type` `lora`, `adapter.lora.alpha` (the scale is
//! `alpha / rank`, or 1 when alpha is 0, as llama.cpp applies it; PEFT's rslora and patterns do
//! not survive its converter), tensors `blk.N.<attn_q|attn_k|attn_v|attn_output|ffn_gate|
//! ffn_up|ffn_down>.weight.lora_a` (`[rank, in]` row-major) and `.lora_b` (`[out, rank]`), in
//! F32, F16, BF16 or Q8_0. For llama-family files the converter permuted the rows of q's and
//! k's `lora_b` as it permutes the base's q and k (its rope pairs neighbours, this engine pairs
//! halves, as transformers does); they are put back, whatever format the base is in. Activated
//! LoRA (`adapter.alora.*`) and tensors for anything but the seven projections are refused.
//!
//! Every file is opened through [`super::files`]: a regular file only (not a FIFO, device or
//! directory), the config at most 1 MiB and the weights at most what an adapter of the largest
//! accepted rank could take for this model, read from the descriptor that was checked.

use std::collections::HashMap;
use std::path::Path;

use safetensors::{Dtype, SafeTensors};
use serde::Deserialize;

use super::files::{CONFIG_MAX, open_regular, read_regular, shown};
use super::le_vec;
use super::{ModelConfig, ModelError};

/// The projections an adapter may change, in a layer's order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Target {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

impl Target {
    pub const ALL: [Target; 7] = [
        Target::Q,
        Target::K,
        Target::V,
        Target::O,
        Target::Gate,
        Target::Up,
        Target::Down,
    ];

    /// The module's name in Hugging Face's Llama (`q_proj`, …).
    pub fn module(self) -> &'static str {
        match self {
            Target::Q => "q_proj",
            Target::K => "k_proj",
            Target::V => "v_proj",
            Target::O => "o_proj",
            Target::Gate => "gate_proj",
            Target::Up => "up_proj",
            Target::Down => "down_proj",
        }
    }

    fn from_module(name: &str) -> Option<Target> {
        Target::ALL.into_iter().find(|t| t.module() == name)
    }

    /// `(in, out)` features of this projection in a model shaped by `c`.
    pub fn dims(self, c: &ModelConfig) -> (usize, usize) {
        let (h, qd, kvd) = (c.hidden, c.heads * c.head_dim, c.kv_heads * c.head_dim);
        match self {
            Target::Q => (h, qd),
            Target::K | Target::V => (h, kvd),
            Target::O => (qd, h),
            Target::Gate | Target::Up => (h, c.intermediate),
            Target::Down => (c.intermediate, h),
        }
    }
}

/// One projection's addition: `y += scale · B · (A · x)`.
#[derive(Debug, Clone)]
pub struct LoraPair {
    pub rank: usize,
    pub inp: usize,
    pub out: usize,
    /// `[inp, rank]`: PEFT's `lora_A.weight` (`[rank, inp]`) transposed.
    pub at: Vec<f32>,
    /// `[rank, out]`: PEFT's `lora_B.weight` (`[out, rank]`) transposed, times the scale.
    pub bt: Vec<f32>,
}

/// An adapter's additions, per layer and projection.
#[derive(Debug, Clone)]
pub struct LoraAdapter {
    /// `layers[l][t as usize]`.
    layers: Vec<[Option<LoraPair>; 7]>,
    /// The largest rank of any projection.
    pub rank: usize,
    /// Unique in the process, one per read: what a device backend keys its copy by.
    pub id: u64,
    /// Each file's size and modification time as the descriptor it was read from said:
    /// what the ingress versions an adapter by, without looking at the paths again.
    stamps: Vec<Stamp>,
}

/// A file's size and modification time.
pub type Stamp = (u64, Option<std::time::SystemTime>);

fn stamp(m: &std::fs::Metadata) -> Stamp {
    (m.len(), m.modified().ok())
}

/// Adapters an ingress has just read to check them, handed to the workers of the same
/// process ([`hand_over`], [`handed_over`]), so that a graph in one process reads an
/// adapter's files once between its ingress and its workers. Keyed by the ingress's version
/// key (the `LoraRef`'s: name, path and the files' stamps) and the base model's shape. Only
/// while a worker's adapter store lives in the process ([`StoreOpen`]; a graph's workers are
/// built before its ingress opens), so an ingress of its own keeps nothing. A worker takes
/// an adapter out on its first request for it; one never asked for is dropped after
/// [`HANDOVER_HOLD`], and the list is bounded in adapters and bytes (the oldest go first).
static HANDOVER: parking_lot::Mutex<Vec<Handover>> = parking_lot::Mutex::new(Vec::new());

/// Worker adapter stores alive in this process.
static STORES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// How long a checked adapter waits for a worker of the process.
pub const HANDOVER_HOLD: std::time::Duration = std::time::Duration::from_secs(300);

/// Adapters held for workers at most.
const HANDOVER_MAX: usize = 16;

/// Bytes of adapters held for workers at most.
const HANDOVER_MAX_BYTES: usize = 1 << 30;

/// A worker's adapter store, alive: while one is, checked adapters are handed over.
pub struct StoreOpen(());

impl StoreOpen {
    pub fn new() -> Self {
        STORES.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        StoreOpen(())
    }
}

impl Default for StoreOpen {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for StoreOpen {
    fn drop(&mut self) {
        if STORES.fetch_sub(1, std::sync::atomic::Ordering::AcqRel) == 1 {
            HANDOVER.lock().clear();
        }
    }
}

struct Handover {
    key: String,
    base: ModelConfig,
    adapter: std::sync::Arc<LoraAdapter>,
    until: std::time::Instant,
}

/// Offer `adapter`, read for `base` and versioned as `key`, to this process's workers (none:
/// dropped).
pub fn hand_over(key: String, base: &ModelConfig, adapter: std::sync::Arc<LoraAdapter>) {
    if STORES.load(std::sync::atomic::Ordering::Acquire) == 0 {
        return;
    }
    let now = std::time::Instant::now();
    let mut h = HANDOVER.lock();
    h.retain(|e| e.until > now && e.key != key);
    let bytes = adapter.bytes();
    while !h.is_empty()
        && (h.len() >= HANDOVER_MAX
            || h.iter().map(|e| e.adapter.bytes()).sum::<usize>() + bytes > HANDOVER_MAX_BYTES)
    {
        h.remove(0);
    }
    if bytes > HANDOVER_MAX_BYTES {
        return;
    }
    h.push(Handover {
        key,
        base: base.clone(),
        adapter,
        until: now + HANDOVER_HOLD,
    });
}

/// The adapter versioned as `key` for `base` that this process's ingress read, if it is
/// still held: taken out (the worker keeps it from now on, within its own bound).
pub fn handed_over(key: &str, base: &ModelConfig) -> Option<std::sync::Arc<LoraAdapter>> {
    let now = std::time::Instant::now();
    let mut h = HANDOVER.lock();
    h.retain(|e| e.until > now);
    let i = h.iter().position(|e| e.key == key && e.base == *base)?;
    Some(h.remove(i).adapter)
}

/// Next [`LoraAdapter::id`].
static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// A projection's `lora_A` and `lora_B` as they are read, and the module's path.
struct Halves {
    a: Option<Vec<f32>>,
    b: Option<Vec<f32>>,
    module: String,
}

/// PEFT's `adapter_config.json`, the fields that change what the weights mean.
#[derive(Debug, Deserialize)]
struct PeftConfig {
    #[serde(default)]
    peft_type: Option<String>,
    r: usize,
    lora_alpha: f64,
    #[serde(default)]
    use_rslora: bool,
    #[serde(default)]
    use_dora: bool,
    #[serde(default)]
    fan_in_fan_out: bool,
    #[serde(default)]
    bias: Option<String>,
    #[serde(default)]
    lora_bias: bool,
    #[serde(default)]
    modules_to_save: Option<Vec<String>>,
    #[serde(default)]
    layer_replication: Option<serde_json::Value>,
    #[serde(default)]
    target_parameters: Option<serde_json::Value>,
    #[serde(default)]
    rank_pattern: HashMap<String, usize>,
    #[serde(default)]
    alpha_pattern: HashMap<String, f64>,
}

/// The largest rank accepted: far above what adapters use (8 to 256), and a bound on what a
/// file can make the process allocate per row.
pub const MAX_RANK: usize = 4096;

impl LoraAdapter {
    /// The addition to projection `t` of layer `layer`, if the adapter changes it.
    pub fn pair(&self, layer: usize, t: Target) -> Option<&LoraPair> {
        self.layers.get(layer)?[t as usize].as_ref()
    }

    /// The layers it was read for (the base model's).
    pub fn layers(&self) -> usize {
        self.layers.len()
    }

    /// Whether the adapter changes `t` in any layer.
    pub fn changes(&self, t: Target) -> bool {
        self.layers.iter().any(|l| l[t as usize].is_some())
    }

    /// The size and modification time of each file it was read from, as read.
    pub fn stamps(&self) -> &[Stamp] {
        &self.stamps
    }

    /// Bytes its weights take.
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .flatten()
            .map(|p| 4 * (p.at.len() + p.bt.len()))
            .sum()
    }

    /// Read a PEFT adapter directory for a model shaped by `c`.
    pub fn load_peft(dir: &Path, c: &ModelConfig) -> Result<Self, ModelError> {
        let cfg_path = dir.join("adapter_config.json");
        let (text, cfg_meta) = read_regular(&cfg_path, CONFIG_MAX)?;
        let cfg: PeftConfig = serde_json::from_slice(&text)
            .map_err(|e| ModelError::Config(format!("{}: {e}", shown(&cfg_path))))?;
        let bad = |m: String| ModelError::Config(format!("{}: {m}", shown(&cfg_path)));
        if let Some(t) = cfg.peft_type.as_deref().filter(|t| *t != "LORA") {
            return Err(bad(format!("peft_type {t} is not LORA")));
        }
        if cfg.use_dora {
            return Err(bad("DoRA adapters (use_dora) are not supported".into()));
        }
        if cfg.fan_in_fan_out {
            return Err(bad(
                "fan_in_fan_out adapters (GPT-2 style Conv1D) are not supported".into(),
            ));
        }
        if cfg.lora_bias || cfg.bias.as_deref().is_some_and(|b| b != "none") {
            return Err(bad("adapters with trained biases are not supported".into()));
        }
        if let Some(m) = cfg.modules_to_save.as_ref().filter(|m| !m.is_empty()) {
            return Err(bad(format!(
                "modules_to_save {m:?}: an adapter that replaces whole modules is not supported"
            )));
        }
        let set = |v: &Option<serde_json::Value>| {
            v.as_ref()
                .is_some_and(|v| !(v.is_null() || v.as_array().is_some_and(Vec::is_empty)))
        };
        if set(&cfg.layer_replication) || set(&cfg.target_parameters) {
            return Err(bad(
                "layer_replication and target_parameters adapters are not supported".into(),
            ));
        }
        if cfg.r == 0 || cfg.r > MAX_RANK {
            return Err(bad(format!("r must be 1 to {MAX_RANK}, got {}", cfg.r)));
        }
        let path = dir.join("adapter_model.safetensors");
        // Bounded by what an adapter of this model could hold, read from the descriptor
        // that was checked.
        let (bytes, weights_meta) = read_regular(&path, most_bytes(c))?;
        let st = SafeTensors::deserialize(&bytes)
            .map_err(|e| ModelError::Weights(format!("{}: {e}", shown(&path))))?;
        let mut parts: HashMap<(usize, Target), Halves> = HashMap::new();
        for name in st.names() {
            let (layer, target, is_a, module) = parse_name(name).ok_or_else(|| {
                ModelError::Weights(format!(
                    "{}: tensor {name} is not a LoRA A or B of a decoder layer's projection (q/k/v/o, gate/up/down)",
                    shown(&path)
                ))
            })?;
            if layer >= c.layers {
                return Err(ModelError::Weights(format!(
                    "{}: tensor {name} is for layer {layer}; the base model has {}",
                    shown(&path),
                    c.layers
                )));
            }
            let t = st
                .tensor(name)
                .map_err(|e| ModelError::Weights(format!("{}: {name}: {e}", shown(&path))))?;
            let (inp, out) = target.dims(c);
            let rank = match (is_a, t.shape()) {
                (true, [r, i]) if *i == inp => *r,
                (false, [o, r]) if *o == out => *r,
                (_, shape) => {
                    let want = if is_a { "[r, {inp}]" } else { "[{out}, r]" };
                    let want = want
                        .replace("{inp}", &inp.to_string())
                        .replace("{out}", &out.to_string());
                    return Err(ModelError::Weights(format!(
                        "{}: tensor {name} has shape {shape:?}; the base model's {} needs {want}: an adapter for another model?",
                        shown(&path),
                        target.module()
                    )));
                }
            };
            if rank == 0 || rank > MAX_RANK {
                return Err(ModelError::Weights(format!(
                    "{}: tensor {name} has rank {rank}; 1 to {MAX_RANK} is accepted",
                    shown(&path)
                )));
            }
            let data: Vec<f32> = match t.dtype() {
                Dtype::F32 => le_vec(t.data()),
                Dtype::F16 => le_vec::<half::f16>(t.data())
                    .iter()
                    .map(|v| v.to_f32())
                    .collect(),
                Dtype::BF16 => le_vec::<half::bf16>(t.data())
                    .iter()
                    .map(|v| v.to_f32())
                    .collect(),
                other => {
                    return Err(ModelError::Weights(format!(
                        "{}: tensor {name} is {other:?}; supported: F32, F16, BF16",
                        shown(&path)
                    )));
                }
            };
            let e = parts.entry((layer, target)).or_insert(Halves {
                a: None,
                b: None,
                module,
            });
            let half = if is_a { &mut e.a } else { &mut e.b };
            if half.replace(data).is_some() {
                return Err(ModelError::Weights(format!(
                    "{}: {} has two lora_{}",
                    shown(&path),
                    e.module,
                    if is_a { "A" } else { "B" }
                )));
            }
        }
        if parts.is_empty() {
            return Err(ModelError::Weights(format!(
                "{}: no LoRA tensors",
                shown(&path)
            )));
        }
        let mut pairs = Vec::with_capacity(parts.len());
        for ((layer, target), Halves { a, b, module }) in parts {
            let (Some(a), Some(b)) = (a, b) else {
                return Err(ModelError::Weights(format!(
                    "{}: {module} has only one of lora_A and lora_B",
                    shown(&path)
                )));
            };
            let (inp, _) = target.dims(c);
            let rank = a.len() / inp;
            let alpha = pattern(&cfg.alpha_pattern, &module).unwrap_or(cfg.lora_alpha);
            let r = pattern(&cfg.rank_pattern, &module).unwrap_or(cfg.r);
            if r != rank {
                return Err(ModelError::Weights(format!(
                    "{}: {module} has rank {rank}, the config says {r}",
                    shown(&path)
                )));
            }
            let scale = if cfg.use_rslora {
                alpha / (rank as f64).sqrt()
            } else {
                alpha / rank as f64
            } as f32;
            pairs.push(Pieces {
                layer,
                target,
                a,
                b,
                scale,
                what: format!("{}: {module}", shown(&path)),
            });
        }
        let mut adapter = assemble(c, pairs)?;
        adapter.stamps = vec![stamp(&cfg_meta), stamp(&weights_meta)];
        Ok(adapter)
    }

    /// Read an adapter for a model shaped by `c`: a GGUF LoRA file (by its `.gguf` extension),
    /// else a PEFT directory.
    pub fn load(path: &Path, c: &ModelConfig) -> Result<Self, ModelError> {
        if super::gguf::is_gguf(path) {
            Self::load_gguf(path, c)
        } else {
            Self::load_peft(path, c)
        }
    }

    /// The files an adapter at `path` is read from (to version them): the GGUF file, or the
    /// PEFT directory's two.
    pub fn files(path: &Path) -> Vec<std::path::PathBuf> {
        if super::gguf::is_gguf(path) {
            vec![path.to_owned()]
        } else {
            ["adapter_config.json", "adapter_model.safetensors"]
                .iter()
                .map(|f| path.join(f))
                .collect()
        }
    }

    /// Read a GGUF LoRA file (llama.cpp's) for a model shaped by `c`.
    pub fn load_gguf(path: &Path, c: &ModelConfig) -> Result<Self, ModelError> {
        let bad = |m: String| ModelError::Weights(format!("{}: {m}", shown(path)));
        // Weighed before it is read (a model file is far larger than its adapters), then read
        // whole from the descriptor that was weighed.
        let most = most_bytes(c);
        let (file, meta) = open_regular(path, u64::MAX)?;
        if meta.len() > most {
            return Err(bad(format!(
                "{} bytes: not a LoRA adapter of this model (at most {most} bytes)",
                meta.len()
            )));
        }
        let g = super::gguf::Gguf::read_checked(path, file, meta.len())?;
        let text = |k: &str| g.get(k).and_then(super::gguf::Value::as_str);
        match (text("general.type"), text("adapter.type")) {
            (Some("adapter") | None, Some("lora")) => {}
            (t, a) => {
                return Err(bad(format!(
                    "not a LoRA adapter (general.type {t:?}, adapter.type {a:?}); a model file is no adapter"
                )));
            }
        }
        if g.meta.keys().any(|k| k.starts_with("adapter.alora")) {
            return Err(bad(
                "activated LoRA (adapter.alora.*) adapters are not supported".into(),
            ));
        }
        let alpha = g
            .get("adapter.lora.alpha")
            .and_then(super::gguf::Value::as_f64)
            .unwrap_or(0.0);
        if !alpha.is_finite() {
            return Err(bad(format!("adapter.lora.alpha is {alpha}")));
        }
        // llama.cpp's converter permutes llama-family q and k rows (not qwen2's).
        let permuted = text("general.architecture") != Some("qwen2");
        let mut halves: HashMap<(usize, Target), Halves> = HashMap::new();
        let names: Vec<String> = g.tensor_names().map(str::to_owned).collect();
        for name in &names {
            let (layer, target, is_a) = gguf_name(name).ok_or_else(|| {
                bad(format!(
                    "tensor {name} is not a LoRA a or b of a decoder layer's projection (attn_q/k/v/output, ffn_gate/up/down)"
                ))
            })?;
            if layer >= c.layers {
                return Err(bad(format!(
                    "tensor {name} is for layer {layer}; the base model has {}",
                    c.layers
                )));
            }
            let (dims, data) = g.tensor_f32(name)?;
            let (inp, out) = target.dims(c);
            // ggml's order: `[in, rank]` for a, `[rank, out]` for b.
            let rank = match (is_a, dims.as_slice()) {
                (true, [i, r]) if *i == inp => *r,
                (false, [r, o]) if *o == out => *r,
                (_, d) => {
                    return Err(bad(format!(
                        "tensor {name} has dims {d:?}; the base model's {} takes {inp} and gives {out}: an adapter for another model?",
                        target.module()
                    )));
                }
            };
            if rank == 0 || rank > MAX_RANK {
                return Err(bad(format!(
                    "tensor {name} has rank {rank}; 1 to {MAX_RANK} is accepted"
                )));
            }
            let e = halves.entry((layer, target)).or_insert(Halves {
                a: None,
                b: None,
                module: format!("blk.{layer}.{}", gguf_module(target)),
            });
            let half = if is_a { &mut e.a } else { &mut e.b };
            if half.replace(data).is_some() {
                return Err(bad(format!("{name} appears twice")));
            }
        }
        if halves.is_empty() {
            return Err(bad("no LoRA tensors".into()));
        }
        let mut pairs = Vec::with_capacity(halves.len());
        for ((layer, target), Halves { a, b, module }) in halves {
            let (Some(a), Some(mut b)) = (a, b) else {
                return Err(bad(format!("{module} has only one of lora_a and lora_b")));
            };
            let (inp, out) = target.dims(c);
            let rank = a.len() / inp;
            if permuted && matches!(target, Target::Q | Target::K) && b.len() == out * rank {
                let heads = if target == Target::Q {
                    c.heads
                } else {
                    c.kv_heads
                };
                let order = super::gguf::rotary_order(heads, c.head_dim);
                b = order
                    .iter()
                    .flat_map(|&row| b[row * rank..(row + 1) * rank].iter().copied())
                    .collect();
            }
            let scale = if alpha == 0.0 {
                1.0
            } else {
                (alpha / rank as f64) as f32
            };
            pairs.push(Pieces {
                layer,
                target,
                a,
                b,
                scale,
                what: format!("{}: {module}", shown(path)),
            });
        }
        let mut adapter = assemble(c, pairs)?;
        adapter.stamps = vec![stamp(&meta)];
        Ok(adapter)
    }
}

/// One projection's two matrices as read (`a` `[rank, in]`, `b` `[out, rank]`, row-major,
/// PEFT's layout) and its scale.
struct Pieces {
    layer: usize,
    target: Target,
    a: Vec<f32>,
    b: Vec<f32>,
    scale: f32,
    /// The file and module, for errors.
    what: String,
}

/// The adapter: each projection's `Aᵀ` and scaled `Bᵀ`, after checking the two agree.
fn assemble(c: &ModelConfig, pairs: Vec<Pieces>) -> Result<LoraAdapter, ModelError> {
    let mut layers: Vec<[Option<LoraPair>; 7]> =
        (0..c.layers).map(|_| Default::default()).collect();
    let mut max_rank = 0;
    for p in pairs {
        let (inp, out) = p.target.dims(c);
        let rank = p.a.len() / inp;
        if rank == 0 || p.a.len() != inp * rank || p.b.len() != out * rank {
            return Err(ModelError::Weights(format!(
                "{}: lora A has rank {rank}, lora B {}",
                p.what,
                p.b.len() / out.max(1)
            )));
        }
        let mut bt = vec![0.0; rank * out];
        for o in 0..out {
            for j in 0..rank {
                bt[j * out + o] = p.b[o * rank + j] * p.scale;
            }
        }
        let mut at = vec![0.0; inp * rank];
        for j in 0..rank {
            for k in 0..inp {
                at[k * rank + j] = p.a[j * inp + k];
            }
        }
        max_rank = max_rank.max(rank);
        layers[p.layer][p.target as usize] = Some(LoraPair {
            rank,
            inp,
            out,
            at,
            bt,
        });
    }
    Ok(LoraAdapter {
        layers,
        rank: max_rank,
        stamps: Vec::new(),
        id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
    })
}

/// The most bytes an adapter of a model shaped by `c` can take: every projection of every
/// layer at the largest rank (in f32), and a header. Files are bounded by it before they are
/// read.
fn most_bytes(c: &ModelConfig) -> u64 {
    Target::ALL
        .iter()
        .map(|t| {
            let (i, o) = t.dims(c);
            (MAX_RANK * (i + o) * 4) as u64
        })
        .sum::<u64>()
        .saturating_mul(c.layers as u64)
        .saturating_add(1 << 24)
}

/// GGUF's name for a projection (llama.cpp's tensor names).
fn gguf_module(t: Target) -> &'static str {
    match t {
        Target::Q => "attn_q",
        Target::K => "attn_k",
        Target::V => "attn_v",
        Target::O => "attn_output",
        Target::Gate => "ffn_gate",
        Target::Up => "ffn_up",
        Target::Down => "ffn_down",
    }
}

/// `blk.3.attn_q.weight.lora_a` → (3, Q, a); `None` for anything else.
fn gguf_name(name: &str) -> Option<(usize, Target, bool)> {
    let (base, ab) = name.rsplit_once(".weight.lora_")?;
    let is_a = match ab {
        "a" => true,
        "b" => false,
        _ => return None,
    };
    let (layer, module) = base.strip_prefix("blk.")?.split_once('.')?;
    let target = Target::ALL
        .into_iter()
        .find(|t| gguf_module(*t) == module)?;
    Some((layer.parse().ok()?, target, is_a))
}

/// `base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` → (3, Q, A, the module's
/// path `model.layers.3.self_attn.q_proj`); `None` for anything else.
fn parse_name(name: &str) -> Option<(usize, Target, bool, String)> {
    let (module, tail) = name
        .strip_suffix(".weight")?
        .rsplit_once('.')
        .filter(|(_, ab)| matches!(*ab, "lora_A" | "lora_B"))?;
    let is_a = tail == "lora_A";
    let module = module.strip_prefix("base_model.model.").unwrap_or(module);
    let (path, proj) = module.rsplit_once('.')?;
    let target = Target::from_module(proj)?;
    // The decoder's layers only (not, say, a vision tower's `…encoder.layers.3…`).
    let after = path.strip_prefix("model.layers.")?;
    let (index, kind) = after.split_once('.')?;
    if !matches!(
        (kind, target),
        ("self_attn", Target::Q | Target::K | Target::V | Target::O)
            | ("mlp", Target::Gate | Target::Up | Target::Down)
    ) {
        return None;
    }
    let layer = index.parse().ok()?;
    Some((layer, target, is_a, module.to_owned()))
}

/// A `rank_pattern`/`alpha_pattern` value for `module`: a key equal to its path or to the end
/// of it after a dot (PEFT matches `(.*\.)?key$`).
fn pattern<T: Copy>(patterns: &HashMap<String, T>, module: &str) -> Option<T> {
    patterns
        .iter()
        .filter(|(k, _)| module == k.as_str() || module.ends_with(&format!(".{k}")))
        // The longest key is the most specific.
        .max_by_key(|(k, _)| k.len())
        .map(|(_, v)| *v)
}
