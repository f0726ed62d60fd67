//! The payloads of an LLM graph, in the order a request meets them:
//!
//! ```text
//! http ──LlmRequest──▶ preprocess ──PreprocessedRequest──▶ route ──PreprocessedRequest──▶ decode
//!      ◀──LlmDelta── postprocess ◀══Generated stream══
//! ```
//!
//! All of them have a wire codec, so any edge may cross a process boundary.

use bytes::BufMut;
use dyn_core::payload::CodecError;
use dyn_core::{Codec, Payload, Resumable, Resume};
use serde::{Deserialize, Serialize};

/// Which OpenAI endpoint a request came in on; decides how the prompt is built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Endpoint {
    Chat,
    Completion,
}

/// One chat message with its content already flattened to text, and what tool calling adds:
/// an assistant turn's calls and a tool result's call id, as Hugging Face chat templates read
/// them (`tool_calls[i].function.arguments` a JSON object, not OpenAI's string).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    /// A plain message.
    pub fn text(role: &str, content: &str) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
            name: None,
        }
    }
}

/// What the model is asked to continue.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Prompt {
    /// A conversation, rendered through the model's chat template.
    Messages(Vec<ChatMessage>),
    /// Raw text, tokenized as is (with the tokenizer's special tokens, e.g. bos).
    Text(String),
    /// Token ids, used as they are.
    Tokens(Vec<u32>),
}

/// How an embedding is made of a prompt's final hidden states (after the model's last norm):
/// the last token's (what decoder models embed with), or the mean of every token's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pooling {
    Last,
    Mean,
}

/// `v` scaled to unit length, as vLLM and sentence-transformers normalise embeddings (summed
/// in f64); a zero vector stays zero.
pub fn normalized(mut v: Vec<f32>) -> Vec<f32> {
    let norm = v
        .iter()
        .map(|x| f64::from(*x) * f64::from(*x))
        .sum::<f64>()
        .sqrt();
    if norm > 0.0 {
        v.iter_mut()
            .for_each(|x| *x = (f64::from(*x) / norm) as f32);
    }
    v
}

/// Sampling parameters as the client sent them; `None` means the model's default.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Sampling {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// Keep the k most likely tokens (vLLM's extension).
    #[serde(default)]
    pub top_k: Option<u32>,
    pub seed: Option<u64>,
    /// Drop tokens less likely than this share of the most likely one (vLLM's extension).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_p: Option<f32>,
    /// OpenAI's penalties on tokens already in the output, per occurrence and once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frequency_penalty: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub presence_penalty: Option<f32>,
    /// Hugging Face's penalty on tokens in the prompt or the output (vLLM's extension; 1: off).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repetition_penalty: Option<f32>,
    /// Added to these tokens' logits (OpenAI's `logit_bias`), sorted by token id.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub logit_bias: Vec<(u32, f32)>,
    /// Return the log-probability of each output token and of this many alternatives
    /// (OpenAI's `logprobs`/`top_logprobs`; `Some(0)`: the chosen token's only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<u32>,
    /// The same for each prompt token after the first (completions' `echo` with `logprobs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<u32>,
    /// The output must match this grammar (structured output); the engine enforces it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub constraint: Option<Constraint>,
    /// An embeddings request: the engine computes the prompt and answers with its final
    /// hidden states pooled this way (normalised), sampling nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub embed: Option<Pooling>,
}

/// A request's sampling parameters with each one the client left out at its neutral value
/// (OpenAI's: temperature 1, no top-k, top-p 1, no min-p, no penalties). The graph's
/// defaults were applied by the ingress's check already; this is what an engine reads, so the
/// neutral values are spelled once.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Drawn {
    pub temperature: f32,
    /// 0: no top-k.
    pub top_k: u32,
    pub top_p: f32,
    pub min_p: f32,
    /// Hugging Face's repetition penalty (1: off).
    pub repetition: f32,
    pub frequency: f32,
    pub presence: f32,
}

impl Sampling {
    /// The parameters as an engine draws by them.
    pub fn drawn(&self) -> Drawn {
        Drawn {
            temperature: self.temperature.unwrap_or(1.0),
            top_k: self.top_k.unwrap_or(0),
            top_p: self.top_p.unwrap_or(1.0),
            min_p: self.min_p.unwrap_or(0.0),
            repetition: self.repetition_penalty.unwrap_or(1.0),
            frequency: self.frequency_penalty.unwrap_or(0.0),
            presence: self.presence_penalty.unwrap_or(0.0),
        }
    }

    /// Whether the client asked for any penalty (an engine that cannot leave one out says
    /// all three then).
    pub fn penalized(&self) -> bool {
        self.repetition_penalty.is_some()
            || self.presence_penalty.is_some()
            || self.frequency_penalty.is_some()
    }
}

/// Where and in what order a request runs, and whose cached KV it may share: set by the
/// ingress (and `yields` by the router's admission), read by admission queues, routers and
/// engine schedulers, never by a sampler. It travels beside [`Sampling`], which says only how
/// the output's tokens are drawn, unchanged from the client to the engine.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Routing {
    /// Scheduling priority, lower first (vLLM's `priority`; 0 by default): the router's
    /// admission queue orders waiting requests by it.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub priority: i32,
    /// Set by the router's admission: the request was sent while its tenant held its share of
    /// the places or more, so an engine may preempt it for a request of the same priority that
    /// does not give way (see [`Precedence`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub yields: bool,
    /// Whose request it is (the API key's tenant, or the ingress's tenant header): the
    /// admission queue shares capacity between tenants by it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// The conversation it belongs to (`x-session-id`, else OpenAI's `user`): a router with
    /// session affinity keeps a session's requests on one worker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    /// vLLM's `cache_salt`: requests share prefix-cache blocks only with requests of the same
    /// salt (none: only with unsalted ones). Engines and routers hash the prompt's blocks
    /// with it (`crate::kv::salt_hash`). The client's, else, behind API keys, its
    /// tenant's ([`tenant_cache_salt`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_salt: Option<String>,
    /// The LoRA adapter it runs with: set by the ingress when the request's `model` names one
    /// (never read from a client's body). Its KV is the adapter's, so engines and routers
    /// hash its blocks apart from other adapters' and the base's (`crate::kv::salt_of`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<LoraRef>,
    /// The latency the client asks for (Dynamo's `nvext.router.ttft_target` and
    /// `itl_target`): where a router chooses among pools, it picks one run for targets at
    /// least this tight.
    #[serde(default, skip_serializing_if = "SlaTargets::is_empty")]
    pub targets: SlaTargets,
}

impl Routing {
    /// Where the request stands for a place in an engine's batch.
    pub fn precedence(&self) -> Precedence {
        Precedence {
            priority: self.priority,
            yields: self.yields,
        }
    }
}

/// A request's latency targets, milliseconds (see [`Routing::targets`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct SlaTargets {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_ms: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub itl_ms: Option<f64>,
}

impl SlaTargets {
    pub fn is_empty(&self) -> bool {
        self.ttft_ms.is_none() && self.itl_ms.is_none()
    }
}

/// A LoRA adapter as a request names it: its name and where its files are (a PEFT
/// directory), which a worker loads on first use.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LoraRef {
    pub name: String,
    pub path: String,
    /// Which version of the files: a hash of the directory's path and its files' sizes and
    /// modification times, taken by the ingress when it checked them. Files changed in place
    /// are another version, neither served from a worker's old copy nor matched against KV
    /// cached under the old one (the disk tier keeps KV across restarts).
    #[serde(default)]
    pub id: u64,
}

impl LoraRef {
    /// What its blocks are hashed with ([`Routing::lora`]): the name and the version, joined
    /// by a NUL, which no model name holds.
    pub fn key(&self) -> String {
        format!("{}\0{:x}", self.name, self.id)
    }
}

/// The longest `cache_salt` a client may send, in characters.
pub const CACHE_SALT_MAX_CHARS: usize = 256;

/// Why a client's `cache_salt` is refused, if it is: 1 to [`CACHE_SALT_MAX_CHARS`]
/// characters, none of them a control character (those are kept for the tenants' default
/// salts, so no client can take one: see [`tenant_cache_salt`]).
pub fn cache_salt_problem(salt: &str) -> Option<String> {
    let chars = salt.chars().count();
    if chars == 0 {
        Some("cache_salt must not be empty".into())
    } else if chars > CACHE_SALT_MAX_CHARS {
        Some(format!(
            "cache_salt must be at most {CACHE_SALT_MAX_CHARS} characters, got {chars}"
        ))
    } else if salt.chars().any(char::is_control) {
        Some("cache_salt must not contain control characters".into())
    } else {
        None
    }
}

/// The salt of a request that has none, where the ingress knows its tenant from its API key:
/// the tenant's own, which no client's `cache_salt` can equal (it starts with a control
/// character), so tenants share no cached prefix unless they send the same salt.
pub fn tenant_cache_salt(tenant: &str) -> String {
    format!("\u{1}tenant:{tenant}")
}

/// Where a request stands for a place in a batch, lower first: its priority (vLLM's, lower
/// first), then whether it gives way ([`Routing::yields`]). Engines with room for no more
/// preempt a running request for a waiting one that comes strictly before it (vLLM's
/// priority scheduling), and the router counts a worker's places by it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Precedence {
    pub priority: i32,
    pub yields: bool,
}

fn is_zero(v: &i32) -> bool {
    *v == 0
}

/// What a structured output must match: OpenAI's `response_format` and vLLM's
/// `structured_outputs`, compiled by [`crate::grammar`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Constraint {
    /// A JSON value valid under this JSON Schema.
    JsonSchema(serde_json::Value),
    /// Any JSON object.
    JsonObject,
    /// Text matching this regular expression (Rust `regex` syntax), whole.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A context-free grammar in llguidance's Lark syntax.
    Lark(String),
    /// Tool calls in a model's markup (a forced call). Kept as a structure rather than
    /// written out as Lark so that each engine gets it in its own dialect: Lark for
    /// llguidance and vLLM, GBNF for llama.cpp (see [`crate::gbnf`]).
    Calls(Calls),
}

/// Calls written as `open`, then one call (more, `sep` between them, where `sep` is set),
/// then `close`; each call is one of `forms`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Calls {
    pub open: String,
    pub close: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sep: Option<String>,
    pub forms: Vec<CallForm>,
}

/// One call: text, a JSON value valid under `schema`, text.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CallForm {
    pub before: String,
    pub schema: serde_json::Value,
    pub after: String,
}

/// Limits on the output as the client sent them.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Limits {
    pub max_tokens: Option<u32>,
    pub min_tokens: Option<u32>,
    pub ignore_eos: bool,
    pub stop: Vec<String>,
    /// Tokens that end the output as eos does (vLLM's `stop_token_ids`), even with
    /// `ignore_eos`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stop_token_ids: Vec<u32>,
    /// Return the prompt's and the answer's token ids (vLLM's `return_token_ids`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub return_token_ids: bool,
    /// Special tokens stay in the text (vLLM's `skip_special_tokens: false`; formats written
    /// in special tokens, such as harmony's channels, need them).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub keep_special: bool,
}

/// An OpenAI request after HTTP parsing: what the ingress sends down the graph.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LlmRequest {
    pub endpoint: Endpoint,
    /// The base model: the ingress names it, for a request of one of its adapters too (the
    /// adapter travels in `routing.lora`); it picks the path of graphs with several models.
    pub model: String,
    pub prompt: Prompt,
    pub sampling: Sampling,
    #[serde(default)]
    pub routing: Routing,
    pub limits: Limits,
    /// The tools offered (OpenAI's `tools`), for the chat template.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tools: Vec<serde_json::Value>,
}

/// When the engine must stop, fully resolved by preprocess.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StopConditions {
    /// Output tokens at most; preprocess guarantees prompt + this fits the context.
    pub max_tokens: u32,
    /// No eos or stop string ends the output before this many tokens.
    pub min_tokens: u32,
    pub ignore_eos: bool,
    pub eos_token_ids: Vec<u32>,
    /// The client's stop tokens: they end the output whatever `ignore_eos` says.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stop_token_ids: Vec<u32>,
}

impl StopConditions {
    /// Every token that ends the output: the model's eos ids (unless eos is ignored), then the
    /// client's stop tokens.
    pub fn stop_tokens(&self, ignore_eos: bool) -> Vec<u32> {
        let eos = if ignore_eos {
            &[][..]
        } else {
            &self.eos_token_ids[..]
        };
        eos.iter().chain(&self.stop_token_ids).copied().collect()
    }
}

/// What postprocess needs to know about a request; the engine hands it back as the first
/// item of its stream ([`Generated::Start`]), because postprocess only sees the engine's output.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutputSpec {
    pub prompt_tokens: u32,
    pub min_tokens: u32,
    /// Stop strings: the output ends before the first one and does not include it.
    pub stop: Vec<String>,
    /// The request's stop tokens: one that ends the output is not part of its text.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stop_token_ids: Vec<u32>,
    /// With `return_token_ids`: the prompt's ids, handed back with the first delta, and the
    /// answer's with each.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
    /// Special tokens stay in the text ([`Limits::keep_special`]); the tokens that end the
    /// output (eos too, then) are in `stop_token_ids`, so they still never show.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub keep_special: bool,
}

/// A tokenized request, ready for an engine. `target` is filled in by `route`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PreprocessedRequest {
    pub model: String,
    /// Bytes in the request's codec, base64 in JSON ([`crate::wire::token_ids`]).
    #[serde(with = "crate::wire::token_ids")]
    pub token_ids: Vec<u32>,
    pub sampling: Sampling,
    #[serde(default)]
    pub routing: Routing,
    pub stop: StopConditions,
    pub output: OutputSpec,
    /// The worker (instance id) a router chose.
    pub target: Option<dyn_core::InstanceId>,
    /// Prompt tokens the chosen worker already caches, as far as the router knows (0 when it
    /// does not track caches).
    #[serde(default)]
    pub cached_tokens: u32,
    /// The prompt was prefilled on another worker: where its KV waits to be pulled.
    #[serde(default)]
    pub prefilled: Option<Prefilled>,
    /// The prompt's block hashes, as far as this process has hashed them (never sent).
    #[serde(skip)]
    pub hashes: crate::kv::PromptHashes,
}

/// An offer's pull key and its lock (see [`Prefilled::key`]).
pub use crate::transfer::{PullKey, PullLock};

/// The result of a remote prefill: the first output token and the prompt's KV blocks,
/// pinned on the prefill worker until the decode worker pulls them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Prefilled {
    /// The prefill worker (instance id).
    pub worker_id: u64,
    /// The token ids the KV covers (the decode worker checks its prompt against this count).
    pub prompt_tokens: u32,
    pub first_token: u32,
    pub transfer: crate::transfer::TransferDescriptor,
    /// The key that pulls the offer, added by the router for the decode worker it chose (the
    /// prefill worker knows only its lock); only over the request plane, never the event plane.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<PullKey>,
}

/// Why a response ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An eos token or a stop string.
    Stop,
    /// `max_tokens` or the context length.
    Length,
    /// The answer is tool calls (set by the frontend's tool parser, never by an engine).
    ToolCalls,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::ToolCalls => "tool_calls",
        }
    }
}

/// What an engine streams back for one request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Generated {
    /// Always first: the request's [`OutputSpec`], echoed.
    Start(OutputSpec),
    /// New tokens (one or more, when the consumer lagged); `finish` on the last; their
    /// log-probabilities when the request asked for them.
    Tokens {
        ids: Vec<u32>,
        finish: Option<FinishReason>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        logprobs: Option<Box<Logprobs>>,
        /// An embeddings request's answer, with its finish (and no tokens).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        embedding: Option<Vec<f32>>,
    },
}

/// One token's log-probability under the model's own distribution (the log-softmax of its
/// logits, before penalties, grammar and temperature, as vLLM reports them), and the most
/// likely alternatives at that position, best first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub top: Vec<(u32, f32)>,
}

/// The log-probabilities that travel with a [`Generated::Tokens`] item.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Logprobs {
    /// The prompt's first token (which has no log-probability), with `prompt`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_first: Option<u32>,
    /// Each prompt token after the first, once, with the request's first tokens.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub prompt: Vec<TokenLogprob>,
    /// One per token of the item, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tokens: Vec<TokenLogprob>,
}

/// A log-probability as the client sees it: the token's text (lossy where it is part of a
/// UTF-8 character) and bytes, with the alternatives in the same form.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TextLogprob {
    pub token: String,
    pub bytes: Vec<u8>,
    /// `None` for the prompt's first token, which nothing predicts.
    pub logprob: Option<f32>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub top: Vec<(String, Vec<u8>, f32)>,
}

/// Token counts for a finished request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
}

/// A piece of the answer after detokenization: what postprocess hands back to the ingress.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LlmDelta {
    pub text: String,
    /// Tokens this delta accounts for (they may decode to no text yet).
    pub tokens: u32,
    pub finish: Option<FinishReason>,
    /// Present on the last delta.
    pub usage: Option<Usage>,
    /// With `logprobs`: one per token of this delta's text.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub logprobs: Vec<TextLogprob>,
    /// With `prompt_logprobs`, on the first delta: every prompt token, the first without one.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub prompt_logprobs: Vec<TextLogprob>,
    /// With `return_token_ids`: this delta's token ids, and on the first the prompt's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
    /// On the last delta, when a stop string ended the answer: which one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_string: Option<String>,
    /// An embeddings request's answer (normalised), on its only delta.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub embedding: Option<Vec<f32>>,
}

macro_rules! json_payload {
    ($($t:ty => $name:literal),* $(,)?) => {$(
        impl Payload for $t {
            const NAME: &'static str = $name;
            fn codec() -> Option<Codec> {
                Some(Codec::json::<Self>())
            }
        }
    )*};
}

json_payload! {
    Prefilled => "Prefilled",
    Generated => "Generated",
    LlmDelta => "LlmDelta",
}

impl Payload for LlmRequest {
    const NAME: &'static str = "LlmRequest";
    fn codec() -> Option<Codec> {
        Some(Codec::json::<Self>())
    }
    /// The base model (the ingress names it, for an adapter too): the runtime sends the
    /// request down that model's path.
    fn model_name(&self) -> Option<&str> {
        Some(&self.model)
    }
}

impl Payload for PreprocessedRequest {
    const NAME: &'static str = "PreprocessedRequest";
    /// MessagePack with its fields named, not JSON: the prompt's ids are one byte string,
    /// copied, where JSON's base64 cost a scalar encode and an escape scan of every byte
    /// (a tenth of the frontend's CPU on a 32k-token turn, and the decode on the worker).
    fn codec() -> Option<Codec> {
        Some(Codec {
            format: "msgpack",
            encode: |value, out| {
                let r = Codec::typed::<Self>(value)?;
                out.reserve(r.wire_size_hint());
                rmp_serde::encode::write_named(&mut out.writer(), r).map_err(|e| {
                    CodecError::Other {
                        type_name: Self::NAME,
                        message: e.to_string(),
                    }
                })
            },
            decode: |bytes| {
                // Nesting bounded as serde_json bounds it (a schema inside a constraint is
                // the only nesting a request has): bytes from the network cannot recurse deep.
                let mut de = rmp_serde::Deserializer::from_read_ref(bytes);
                de.set_max_depth(128);
                Self::deserialize(&mut de)
                    .map(|v| Box::new(v) as dyn_core::payload::AnyPayload)
                    .map_err(|e| CodecError::Other {
                        type_name: Self::NAME,
                        message: e.to_string(),
                    })
            },
        })
    }
    /// The prompt's bytes, the prompt's ids again where the answer returns them (a
    /// MessagePack integer each, up to 5 bytes), and room for the rest (a large schema may
    /// still grow the frame once).
    fn wire_size_hint(&self) -> usize {
        let echoed = self
            .output
            .prompt_token_ids
            .as_ref()
            .map_or(0, |p| p.len() * 5);
        self.token_ids.len() * 4 + echoed + 1024
    }
    fn target_instance(&self) -> Option<dyn_core::InstanceId> {
        self.target
    }
    fn resume() -> Option<Resume> {
        Some(Resume::of::<Self>())
    }
}

/// Migration: a request resent after losing its worker carries the tokens the client already
/// has after its prompt (so the new worker continues from there, and reuses its prefix cache
/// for the prompt), with that many fewer to generate. `output.prompt_tokens` keeps the
/// original prompt length, for usage and for engines to know where the answer starts.
impl Resumable for PreprocessedRequest {
    type Output = Generated;

    /// With room for the whole answer after the prompt: absorbing it never copies a long
    /// prompt again (one token past a full vector copied 32k ids into fresh pages).
    fn keep(&self) -> Self {
        let Self {
            model,
            token_ids,
            sampling,
            routing,
            stop,
            output,
            target,
            cached_tokens,
            prefilled,
            hashes,
        } = self;
        let room = (stop.max_tokens as usize).min(1 << 16);
        let mut ids = Vec::with_capacity(token_ids.len() + room);
        ids.extend_from_slice(token_ids);
        Self {
            model: model.clone(),
            token_ids: ids,
            sampling: sampling.clone(),
            routing: routing.clone(),
            stop: stop.clone(),
            output: output.clone(),
            target: *target,
            cached_tokens: *cached_tokens,
            prefilled: prefilled.clone(),
            hashes: hashes.clone(),
        }
    }

    fn absorb(&mut self, output: &Generated) {
        if let Generated::Tokens { ids, .. } = output {
            self.token_ids.extend_from_slice(ids);
            let n = u32::try_from(ids.len()).unwrap_or(u32::MAX);
            self.stop.max_tokens = self.stop.max_tokens.saturating_sub(n);
            self.stop.min_tokens = self.stop.min_tokens.saturating_sub(n);
        }
    }

    fn is_repeat(output: &Generated) -> bool {
        matches!(output, Generated::Start(_))
    }

    fn clear_target(&mut self) {
        self.target = None;
        self.cached_tokens = 0;
        // The offer was for the lost worker (and is pulled or expired by now).
        self.prefilled = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_crosses_the_request_plane_whole_and_its_ids_as_their_bytes() {
        let mut req = crate::testing::preprocessed((0..5000).map(|i| i * 7919).collect(), 64);
        req.sampling.temperature = Some(0.5);
        req.sampling.logit_bias = vec![(3, -100.0), (9, 2.5)];
        req.sampling.logprobs = Some(2);
        req.sampling.constraint = Some(crate::testing::weather_call(
            serde_json::json!({"enum": ["Paris", "Tokyo"]}),
        ));
        req.routing.priority = -3;
        req.routing.tenant = Some("t".into());
        req.routing.cache_salt = Some("s".into());
        req.routing.lora = Some(LoraRef {
            name: "qv".into(),
            path: "/a".into(),
            id: u64::MAX,
        });
        req.stop.eos_token_ids = vec![2];
        req.output.stop = vec!["\n\n".into()];
        req.target = Some(dyn_core::InstanceId(7));
        req.cached_tokens = 128;
        req.prefilled = Some(Prefilled {
            worker_id: 3,
            prompt_tokens: 5000,
            first_token: 11,
            transfer: crate::transfer::TransferDescriptor {
                agent: "tcp://127.0.0.1:1".into(),
                transfer_id: crate::transfer::TransferId(u128::MAX - 1),
                block_ids: vec![1, 2, 3],
                block_bytes: 4096,
                layout: crate::transfer::BlockLayout::TokenIds,
                dtype: crate::transfer::BlockDType::U32le,
            },
            key: Some(PullKey::random()),
        });
        let codec = PreprocessedRequest::codec().expect("crosses processes");
        let mut bytes = bytes::BytesMut::from(&[0xAA][..]);
        (codec.encode)(&req, &mut bytes).expect("encodes");
        assert_eq!(bytes[0], 0xAA, "appended after what the buffer held");
        // The ids are one byte string of their little-endian bytes.
        let le: Vec<u8> = req.token_ids.iter().flat_map(|t| t.to_le_bytes()).collect();
        assert!(bytes.windows(le.len()).any(|w| w == le.as_slice()));
        assert!(bytes.len() < le.len() + 1024, "{} bytes", bytes.len());
        let back = (codec.decode)(&bytes[1..]).expect("decodes");
        let back = back
            .into_any()
            .downcast::<PreprocessedRequest>()
            .expect("a request");
        assert_eq!(*back, req);
        // A hand-made payload with the ids as a list still reads.
        #[derive(Serialize)]
        struct Listed<'a> {
            model: &'a str,
            token_ids: &'a [u32],
            sampling: Sampling,
            stop: &'a StopConditions,
            output: OutputSpec,
            target: Option<u64>,
        }
        let listed = rmp_serde::to_vec_named(&Listed {
            model: "tiny",
            token_ids: &[1, 2, 3],
            sampling: Sampling::default(),
            stop: &req.stop,
            output: OutputSpec::default(),
            target: None,
        })
        .expect("encodes");
        let back = (codec.decode)(&listed).expect("decodes");
        let back = back
            .into_any()
            .downcast::<PreprocessedRequest>()
            .expect("a request");
        assert_eq!(back.token_ids, [1, 2, 3]);
        assert!((codec.decode)(b"\x92\x01").is_err());
        // Nesting past the bound (a schema 200 arrays deep) is an error, not a deep recursion.
        let mut schema = serde_json::json!(1);
        for _ in 0..200 {
            schema = serde_json::json!([schema]);
        }
        let mut deep = crate::testing::preprocessed(vec![1], 4);
        deep.sampling.constraint = Some(Constraint::JsonSchema(schema));
        let mut bytes = bytes::BytesMut::new();
        (codec.encode)(&deep, &mut bytes).expect("encodes");
        let e = (codec.decode)(&bytes).expect_err("too deep");
        assert!(e.to_string().contains("depth"), "{e}");
    }

    #[test]
    fn cache_salt_travels_and_old_payloads_parse_without_it() {
        let mut req = crate::testing::preprocessed(vec![1, 2, 3], 4);
        let json = serde_json::to_string(&req).expect("json");
        assert!(!json.contains("cache_salt"), "{json}");
        let old: PreprocessedRequest = serde_json::from_str(&json).expect("parses");
        assert_eq!(old.routing.cache_salt, None);
        req.routing.cache_salt = Some("a".into());
        let json = serde_json::to_string(&req).expect("json");
        let back: PreprocessedRequest = serde_json::from_str(&json).expect("parses");
        assert_eq!(back.routing.cache_salt.as_deref(), Some("a"));
    }

    #[test]
    fn a_client_salt_is_short_and_printable_and_never_a_tenants() {
        assert_eq!(cache_salt_problem("a"), None);
        assert_eq!(cache_salt_problem(&"é".repeat(CACHE_SALT_MAX_CHARS)), None);
        assert!(cache_salt_problem("").is_some());
        assert!(cache_salt_problem(&"x".repeat(CACHE_SALT_MAX_CHARS + 1)).is_some());
        assert!(cache_salt_problem("a\nb").is_some());
        assert!(cache_salt_problem(&tenant_cache_salt("acme")).is_some());
        assert_ne!(tenant_cache_salt("acme"), tenant_cache_salt("beta"));
    }
}
