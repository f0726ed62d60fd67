//! `preprocess`: turns an [`LlmRequest`] into token ids an engine can run.
//!
//! Chat messages go through the model's chat template (minijinja, with Python string methods
//! and `raise_exception` as Hugging Face templates expect) and are tokenized without adding
//! special tokens again; completion prompts are tokenized with them, by fastokens where it
//! agrees with the model's Hugging Face tokenizer ([`super::encoder`]). A prompt of a few
//! KiB encodes in microseconds, on the runtime worker that holds the request (a hop to the
//! blocking pool would cost more than the work); a long one runs on tokio's blocking pool,
//! never on a runtime worker. Sampling parameters and lengths are checked here, so every
//! later node can trust them.
//!
//! ```yaml
//! preprocess: {kind: preprocess, inputs: [http], config: {tokenizer: fast}}
//! ```

use std::sync::Arc;

use dyn_core::{
    BuildCx, BuildError, Ctx, Input, Invalid, OpError, Operator, OperatorConfig, Output,
};
use futures::StreamExt;
use minijinja::{Environment, context};
use serde::Deserialize;

use super::encoder::Encoder;
use super::model::{GenerationDefaults, ModelDir};
use super::prefix::PrefixCache;
use dyn_protocol::types::{
    Constraint, LlmRequest, OutputSpec, PreprocessedRequest, Prompt, StopConditions,
};

/// Longest accepted stop string, and most stop strings per request (vLLM has no limit; a cap
/// keeps the matcher's cost per token bounded).
const MAX_STOP_LEN: usize = 256;
const MAX_STOPS: usize = 16;

/// Prompts longer than this (bytes of text) are encoded on the blocking pool: fastokens takes
/// ~5 ns a byte, so 16 KiB is ~80 µs on a runtime worker at most; Hugging Face tokenizers
/// takes ~80× that, so with it every prompt goes to the blocking pool.
const INLINE_ENCODE_BYTES: usize = 16 << 10;

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PreprocessConfig {
    /// Which encoder tokenizes prompts.
    #[serde(default)]
    pub tokenizer: TokenizerChoice,
    /// Sampling for requests that leave a parameter out, over the model's own
    /// `generation_config.json` (a GGUF has none): what the model's card recommends, say. A
    /// request's own fields win.
    #[serde(default)]
    pub defaults: GenerationDefaults,
    /// Tokens the cache of tokenized conversation prefixes may hold (0: no cache). A turn that
    /// extends a conversation tokenizes only its new text ([`crate::prefix`]).
    #[serde(default = "default_prefix_cache_tokens")]
    pub prefix_cache_tokens: usize,
}

/// 8 Mi tokens: 32 MiB, the last turns of ~250 conversations of 32k tokens.
fn default_prefix_cache_tokens() -> usize {
    8 << 20
}

/// Chat prompts shorter than this (bytes of text) are encoded whole, not through the prefix
/// cache: the size up to which a prompt is encoded inline ([`INLINE_ENCODE_BYTES`]).
const CACHED_PROMPT_BYTES: usize = INLINE_ENCODE_BYTES;

/// Conversations the prefix cache keeps at most (each turn's prefix is one entry).
const PREFIX_CACHE_ENTRIES: usize = 4096;

/// `tokenizer:` of `preprocess`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenizerChoice {
    /// fastokens where it loads the model's tokenizer and agrees with Hugging Face
    /// tokenizers on a probe set; Hugging Face tokenizers otherwise.
    #[default]
    Fast,
    /// Hugging Face tokenizers always (for comparisons, or a tokenizer fastokens gets wrong
    /// in a way the probes miss).
    Hf,
}

/// The range checks a request's sampling and a graph's `defaults:` share: each field out of
/// range, with what is wrong.
fn sampling_out_of_range(
    temperature: Option<f32>,
    top_p: Option<f32>,
) -> impl Iterator<Item = (&'static str, String)> {
    let t = temperature.filter(|t| !(0.0..=2.0).contains(t)).map(|t| {
        (
            "temperature",
            format!("temperature must be between 0 and 2, got {t}"),
        )
    });
    let p = top_p
        .filter(|p| !(*p > 0.0 && *p <= 1.0))
        .map(|p| ("top_p", format!("top_p must be in (0, 1], got {p}")));
    t.into_iter().chain(p)
}

/// A graph's `defaults:`: in range, and no zero counts.
fn validate_defaults(d: &GenerationDefaults) -> Vec<Invalid> {
    let mut out: Vec<Invalid> = sampling_out_of_range(d.temperature, d.top_p)
        .map(|(field, msg)| Invalid::field(format!("defaults.{field}"), msg))
        .collect();
    if d.top_k == Some(0) {
        out.push(Invalid::field(
            "defaults.top_k",
            "must be at least 1 (leave it out for all tokens)",
        ));
    }
    if d.max_tokens == Some(0) {
        out.push(Invalid::field("defaults.max_tokens", "must be at least 1"));
    }
    out
}

impl OperatorConfig for PreprocessConfig {
    const KIND: &'static str = "preprocess";
    const SUMMARY: &'static str =
        "Renders the chat template and tokenizes (Hugging Face tokenizer.json); checks parameters";
    type Op = Preprocess;

    fn validate(&self) -> Vec<Invalid> {
        validate_defaults(&self.defaults)
    }

    async fn build(&self, cx: &BuildCx) -> Result<Preprocess, BuildError> {
        let mut p = Preprocess::new(ModelDir::shared(cx).await?)?;
        p.defaults = self.defaults.over(&p.model.defaults);
        p.serves = cx.serves;
        if self.tokenizer == TokenizerChoice::Hf {
            p.encoder = Arc::new(p.encoder.without_fast());
        }
        // Probing the tokenizer's cut points encodes a few texts per added token: off the
        // runtime, as every long encode is.
        let tokens = self.prefix_cache_tokens;
        let p = tokio::task::spawn_blocking(move || p.with_prefix_cache(tokens))
            .await
            .map_err(|e| BuildError::new(format!("prefix cache probe failed: {e}")))?;
        tracing::info!(node = %cx.node, fast = p.encoder.is_fast(), prefix_cache = p.prefixes.is_some(), "prompt encoder");
        Ok(p)
    }
}

pub struct Preprocess {
    model: Arc<ModelDir>,
    /// Sampling for what a request leaves out: the graph's `defaults:` over the model's.
    defaults: GenerationDefaults,
    encoder: Arc<Encoder>,
    env: Option<Arc<Environment<'static>>>,
    /// Tokenized conversation prefixes (the `preprocess` node's; none where the tokenizer
    /// cannot be cut after an added token, or the graph turned it off).
    prefixes: Option<Arc<PrefixCache>>,
    /// What the workers after it can serve: a request for what none of them can is refused
    /// here, in the one pass that checks it.
    serves: dyn_core::planes::Capabilities,
}

const TEMPLATE: &str = "chat";

fn template_env(source: String) -> Result<Environment<'static>, minijinja::Error> {
    let mut env = Environment::new();
    minijinja_contrib::add_to_environment(&mut env);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |msg: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                msg,
            ))
        },
    );
    env.add_template_owned(TEMPLATE, source)?;
    Ok(env)
}

impl Preprocess {
    pub fn new(model: Arc<ModelDir>) -> Result<Self, BuildError> {
        let env = match &model.chat_template {
            Some(src) => Some(Arc::new(template_env(src.clone()).map_err(|e| {
                BuildError::new(format!(
                    "{}: chat template does not compile: {e}",
                    model.path.display()
                ))
            })?)),
            None => None,
        };
        Ok(Self {
            encoder: model.encoder.clone(),
            defaults: model.defaults,
            model,
            env,
            prefixes: None,
            serves: Default::default(),
        })
    }

    /// With a cache of tokenized conversation prefixes of at most `max_tokens` tokens (none
    /// for 0, or where the tokenizer cannot be cut after an added token).
    pub fn with_prefix_cache(mut self, max_tokens: usize) -> Self {
        let added = self.model.tokenizer.get_added_tokens_decoder();
        self.prefixes =
            PrefixCache::new(&self.encoder, added, PREFIX_CACHE_ENTRIES, max_tokens).map(Arc::new);
        self
    }

    /// What the request asks that none of the workers after this node can serve, by their
    /// configs' word ([`dyn_core::planes::Capabilities`]).
    fn check_served(&self, req: &LlmRequest) -> Result<(), OpError> {
        let (s, c) = (&req.sampling, &self.serves);
        let cannot = |can: Option<bool>| can == Some(false);
        if (s.logprobs.is_some() || s.prompt_logprobs.is_some()) && cannot(c.logprobs) {
            return Err(invalid(
                "logprobs",
                "log-probabilities are not available from this model's workers: their engine \
                 computes no model outputs (a simulated one)",
            ));
        }
        if s.embed.is_some() && cannot(c.embeddings) {
            return Err(invalid(
                "model",
                "embeddings are not available from this model's workers: their engine has no \
                 hidden states (a simulated one)",
            ));
        }
        if s.constraint.is_some() && cannot(c.grammars) {
            return Err(invalid(
                "response_format",
                "structured output is not available from this model's workers",
            ));
        }
        if let Some(l) = &req.routing.lora
            && cannot(c.lora)
        {
            return Err(invalid(
                "model",
                format!(
                    "model `{}` is a LoRA adapter; this model's workers run an engine without adapters",
                    l.name
                ),
            ));
        }
        Ok(())
    }

    /// Everything up to tokenization; pure and fast.
    fn check(&self, req: &LlmRequest) -> Result<(), OpError> {
        self.check_served(req)?;
        let s = &req.sampling;
        if let Some((field, msg)) = sampling_out_of_range(s.temperature, s.top_p).next() {
            return Err(invalid(field, msg));
        }
        let l = &req.limits;
        if l.max_tokens == Some(0) {
            return Err(invalid("max_tokens", "max_tokens must be at least 1"));
        }
        if let (Some(min), Some(max)) = (l.min_tokens, l.max_tokens)
            && min > max
        {
            return Err(invalid(
                "min_tokens",
                format!("min_tokens ({min}) is more than max_tokens ({max})"),
            ));
        }
        if l.stop.len() > MAX_STOPS {
            return Err(invalid(
                "stop",
                format!("at most {MAX_STOPS} stop strings, got {}", l.stop.len()),
            ));
        }
        if let Some(bad) = l
            .stop
            .iter()
            .find(|s| s.is_empty() || s.len() > MAX_STOP_LEN)
        {
            return Err(invalid(
                "stop",
                format!(
                    "stop strings must have 1 to {MAX_STOP_LEN} bytes, got {}",
                    bad.len()
                ),
            ));
        }
        let vocab = self.model.vocab_size;
        let outside = |id: u32| format!("token id {id} is outside the vocabulary (size {vocab})");
        if let Some(&id) = req.limits.stop_token_ids.iter().find(|&&id| id >= vocab) {
            return Err(invalid("stop_token_ids", outside(id)));
        }
        if let Some(&(id, _)) = req.sampling.logit_bias.iter().find(|b| b.0 >= vocab) {
            return Err(invalid("logit_bias", outside(id)));
        }
        match &req.prompt {
            Prompt::Messages(m) if m.is_empty() => {
                Err(invalid("messages", "messages must not be empty"))
            }
            Prompt::Tokens(t) if t.is_empty() => Err(invalid("prompt", "prompt must not be empty")),
            Prompt::Tokens(t) => match t.iter().find(|&&id| id >= vocab) {
                Some(&id) => Err(invalid("prompt", outside(id))),
                None => Ok(()),
            },
            _ => Ok(()),
        }
    }

    /// What the chat template adds to the prompt for the answer (after the last message),
    /// e.g. `<|im_start|>assistant\n`; `None` without a template.
    pub fn generation_prompt(&self) -> Option<String> {
        let m = [dyn_protocol::types::ChatMessage::text("user", "x")];
        let with = self.render_with(&m, &[], true).ok()?;
        let without = self.render_with(&m, &[], false).ok()?;
        with.strip_prefix(&without).map(str::to_owned)
    }

    /// The chat prompt's text: the messages and tools through the model's chat template.
    pub fn render_with(
        &self,
        messages: &[dyn_protocol::types::ChatMessage],
        tools: &[serde_json::Value],
        add_generation_prompt: bool,
    ) -> Result<String, OpError> {
        let env = self.env.as_ref().ok_or_else(|| {
            invalid(
                "messages",
                format!(
                    "model '{}' has no chat template; use /v1/completions",
                    self.model.name
                ),
            )
        })?;
        let tmpl = env
            .get_template(TEMPLATE)
            .map_err(|e| OpError::internal(format!("chat template: {e}")))?;
        tmpl.render(context! {
            messages => messages,
            // As transformers' `apply_chat_template(tools=…)`: absent when none.
            tools => (!tools.is_empty()).then_some(tools),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.model.bos_token,
            eos_token => self.model.eos_token,
        })
        .map_err(|e| {
            invalid(
                "messages",
                format!("chat template rejected the messages: {e}"),
            )
        })
    }

    /// A structured output's grammar is within bounds and compiles (on a compile thread; the
    /// model's vocabulary the first time, on the blocking pool), so a schema the library
    /// rejects is a 400 naming the problem rather than an output that ends early. The
    /// compiled grammar is kept: a worker in this process starts the request's guide from it.
    async fn check_grammar(&self, c: Constraint, ignore_eos: bool) -> Result<(), OpError> {
        if ignore_eos {
            return Err(invalid(
                "ignore_eos",
                "ignore_eos cannot be combined with a structured output: the grammar ends it with eos",
            ));
        }
        // The blocking pool only the first time, while the vocabulary is compiled.
        let grammars = match self.model.grammars_built() {
            Some(g) => g,
            None => {
                let model = self.model.clone();
                tokio::task::spawn_blocking(move || model.grammars())
                    .await
                    .map_err(|e| OpError::internal(format!("grammar task failed: {e}")))?
            }
        }
        .map_err(|e| invalid("response_format", e))?;
        grammars.compile(&c).await.map(drop).map_err(grammar_error)
    }

    /// Text tokenized as a request's prompt would be, on the blocking pool when it is long.
    async fn encode(&self, text: String, add_special: bool) -> Result<Vec<u32>, OpError> {
        let ids = if self.encoder.is_fast() && text.len() <= INLINE_ENCODE_BYTES {
            self.encoder.encode(&text, add_special)
        } else {
            let enc = self.encoder.clone();
            tokio::task::spawn_blocking(move || enc.encode(&text, add_special))
                .await
                .map_err(|e| OpError::internal(format!("tokenizer task failed: {e}")))?
        };
        ids.map_err(|e| OpError::internal(format!("tokenizer: {e}")))
    }

    /// vLLM's `/tokenize`: a text prompt's tokens (special tokens such as BOS added unless
    /// `add_special` says not), or chat messages' through the chat template (with the
    /// generation prompt unless told not; special tokens not added on top unless asked).
    /// A request's prompt is read the same way, with the defaults.
    pub async fn tokenize(
        &self,
        prompt: Prompt,
        tools: &[serde_json::Value],
        add_special: Option<bool>,
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, OpError> {
        self.tokenize_in(&[], prompt, tools, add_special, add_generation_prompt)
            .await
    }

    /// [`Self::tokenize`], with chat prompts through the prefix cache (where there is one)
    /// within `scope` (who asks: the tenant, the cache salt).
    async fn tokenize_in(
        &self,
        scope: &[&[u8]],
        prompt: Prompt,
        tools: &[serde_json::Value],
        add_special: Option<bool>,
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, OpError> {
        match prompt {
            Prompt::Text(t) => self.encode(t, add_special.unwrap_or(true)).await,
            Prompt::Messages(m) if m.is_empty() => {
                Err(invalid("messages", "messages must not be empty"))
            }
            Prompt::Messages(m) => {
                let text = self.render_with(&m, tools, add_generation_prompt)?;
                match (&self.prefixes, add_special.unwrap_or(false)) {
                    // A short prompt encodes inline in microseconds: the cache would cost
                    // about what it saves.
                    (Some(cache), false) if text.len() >= CACHED_PROMPT_BYTES => {
                        let tools = serde_json::to_vec(tools).unwrap_or_default();
                        let flag = [u8::from(add_generation_prompt)];
                        let scope: Vec<&[u8]> =
                            scope.iter().copied().chain([&tools[..], &flag]).collect();
                        self.encode_cached(cache, &scope, &m, text).await
                    }
                    (_, add_special) => self.encode(text, add_special).await,
                }
            }
            Prompt::Tokens(t) => Ok(t),
        }
    }

    /// A chat prompt's tokens: the longest tokenized prefix of its conversation from the
    /// cache and the rest encoded; then kept for the conversation's next turn.
    async fn encode_cached(
        &self,
        cache: &PrefixCache,
        scope: &[&[u8]],
        messages: &[dyn_protocol::types::ChatMessage],
        text: String,
    ) -> Result<Vec<u32>, OpError> {
        let keys = cache.keys(scope, messages);
        // `get`, not indexing: equal bytes before the cut make it a char boundary here too,
        // but a hash collision must not be a panic.
        let hit = cache
            .lookup(&keys, &text)
            .and_then(|hit| Some((text.get(hit.cut..)?.to_owned(), hit.tokens)));
        let (tokens, base) = match hit {
            Some((rest, prefix)) => {
                PREFIX_CACHE.with_label_values(&["hit"]).inc();
                let rest = self.encode(rest, false).await?;
                let mut tokens = Vec::with_capacity(prefix.len() + rest.len());
                prefix.extend_into(&mut tokens);
                tokens.extend(rest);
                (tokens, Some(prefix))
            }
            None => {
                PREFIX_CACHE.with_label_values(&["miss"]).inc();
                (self.encode(text.clone(), false).await?, None)
            }
        };
        // A prompt too long to run is not kept: it would only push out conversations that run.
        if let Some(&key) = keys.last()
            && tokens.len() < self.model.context_length as usize
        {
            cache.insert(key, &text, &tokens, base.as_ref());
        }
        Ok(tokens)
    }

    /// The tokens' text, special tokens kept (vLLM's `/detokenize`); ids outside the
    /// vocabulary are the client's error.
    pub fn detokenize(&self, ids: &[u32]) -> Result<String, OpError> {
        let vocab = self.model.vocab_size;
        if let Some(&id) = ids.iter().find(|&&id| id >= vocab) {
            return Err(invalid(
                "tokens",
                format!("token id {id} is outside the vocabulary (0..{vocab})"),
            ));
        }
        self.model
            .tokenizer
            .decode(ids, false)
            .map_err(|e| OpError::internal(format!("tokenizer: {e}")))
    }

    /// Each token's string in the vocabulary (vLLM's `token_strs`).
    pub fn token_strs(&self, ids: &[u32]) -> Vec<String> {
        ids.iter()
            .map(|&id| self.model.tokenizer.id_to_token(id).unwrap_or_default())
            .collect()
    }

    /// The model directory it reads with (its tokens and template, `/tokenizer_info`).
    pub fn model(&self) -> &ModelDir {
        &self.model
    }

    /// The longest prompt plus answer, in tokens.
    pub fn context_length(&self) -> u32 {
        self.model.context_length
    }

    /// How the model's embeddings are pooled, or why it has none ([`ModelDir::pooling`]).
    pub fn pooling(&self) -> Result<dyn_protocol::types::Pooling, &str> {
        self.model.pooling.as_ref().copied().map_err(String::as_str)
    }

    /// The width of an embedding of this model, where its config says.
    pub fn hidden_size(&self) -> Option<u32> {
        self.model.hidden_size
    }

    /// Check, render and tokenize one request (also used by the admin endpoint's dry runs).
    pub async fn preprocess(&self, mut req: LlmRequest) -> Result<PreprocessedRequest, OpError> {
        self.check(&req)?;
        if let Some(c) = req.sampling.constraint.clone() {
            self.check_grammar(c, req.limits.ignore_eos).await?;
        }
        self.defaults.apply(&mut req.sampling);
        // A conversation's prefix is reused within its tenant and cache salt only.
        let tenant = req.routing.tenant.as_deref().unwrap_or_default();
        let salt = req.routing.cache_salt.as_deref().unwrap_or_default();
        let scope = [tenant.as_bytes(), salt.as_bytes()];
        let token_ids = self
            .tokenize_in(&scope, req.prompt, &req.tools, None, true)
            .await?;
        let ctx_len = self.model.context_length;
        let prompt = u32::try_from(token_ids.len()).unwrap_or(u32::MAX);
        let param = if matches!(req.endpoint, dyn_protocol::types::Endpoint::Chat) {
            "messages"
        } else {
            "prompt"
        };
        if prompt >= ctx_len {
            return Err(invalid(param, format!(
                "This model's maximum context length is {ctx_len} tokens; the prompt has {prompt} tokens"
            ))
            .with_code("context_length_exceeded"));
        }
        let room = ctx_len - prompt;
        let max_tokens = match req.limits.max_tokens {
            // An embedding takes the prompt's one pass: the token it stands in for is never
            // output (and its room is there: the prompt is shorter than the context).
            _ if req.sampling.embed.is_some() => 1,
            Some(m) if m > room => {
                return Err(invalid("max_tokens", format!(
                    "This model's maximum context length is {ctx_len} tokens; you asked for {} tokens ({prompt} in the prompt, {m} to generate)",
                    u64::from(prompt) + u64::from(m)
                ))
                .with_code("context_length_exceeded"));
            }
            Some(m) => m,
            None => self.defaults.max_tokens.map_or(room, |d| d.min(room)),
        };
        let min_tokens = req.limits.min_tokens.unwrap_or(0).min(max_tokens);
        let prompt_token_ids = req.limits.return_token_ids.then(|| token_ids.clone());
        let stop = StopConditions {
            max_tokens,
            min_tokens,
            ignore_eos: req.limits.ignore_eos,
            eos_token_ids: self.model.eos_token_ids.clone(),
            stop_token_ids: req.limits.stop_token_ids,
        };
        let keep_special = req.limits.keep_special;
        Ok(PreprocessedRequest {
            model: req.model,
            token_ids,
            sampling: req.sampling,
            routing: req.routing,
            output: OutputSpec {
                prompt_tokens: prompt,
                min_tokens,
                stop: req.limits.stop,
                // With special tokens kept, eos (a special token) would show as text too.
                stop_token_ids: if keep_special {
                    stop.stop_tokens(stop.ignore_eos)
                } else {
                    stop.stop_token_ids.clone()
                },
                prompt_token_ids,
                keep_special,
            },
            stop,
            target: None,
            cached_tokens: 0,
            prefilled: None,
            hashes: Default::default(),
        })
    }
}

/// Chat prompts that found a tokenized prefix of their conversation in the cache, or not.
static PREFIX_CACHE: std::sync::LazyLock<prometheus::IntCounterVec> = std::sync::LazyLock::new(
    || {
        dyn_protocol::metrics::counter_vec(
            "dyn_frontend_prefix_cache_total",
            "Chat prompts by whether a tokenized prefix of their conversation was cached (outcome=hit|miss)",
            &["outcome"],
        )
    },
);

/// A constraint that did not compile: the request's fault (400), or the compiler's turns all
/// taken (503, try again).
pub fn grammar_error(e: crate::grammar::CompileError) -> OpError {
    match e {
        crate::grammar::CompileError::Invalid(e) => invalid(
            "response_format",
            format!("the output grammar is invalid: {e}"),
        ),
        crate::grammar::CompileError::Busy(e) => OpError::overloaded(e),
        e @ crate::grammar::CompileError::Abandoned => OpError::overloaded(e.to_string()),
    }
}

fn invalid(param: &str, message: impl Into<String>) -> OpError {
    OpError::invalid(message).with_param(param)
}

impl Operator for Preprocess {
    type In = LlmRequest;
    type Out = PreprocessedRequest;

    fn call(&self, _ctx: Ctx, mut input: Input<LlmRequest>) -> Output<PreprocessedRequest> {
        let this = Preprocess {
            model: self.model.clone(),
            encoder: self.encoder.clone(),
            defaults: self.defaults,
            env: self.env.clone(),
            prefixes: self.prefixes.clone(),
            serves: self.serves,
        };
        async_stream::stream! {
            while let Some(req) = input.next().await {
                yield this.preprocess(req).await;
            }
        }
        .boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dyn_protocol::types::{ChatMessage, Endpoint, Limits, Sampling};

    fn pre() -> Preprocess {
        Preprocess::new(Arc::new(crate::model::tests::tiny())).expect("builds")
    }

    fn chat(content: &str) -> LlmRequest {
        LlmRequest {
            endpoint: Endpoint::Chat,
            model: "tiny".into(),
            prompt: Prompt::Messages(vec![ChatMessage::text("user", content)]),
            sampling: Sampling::default(),
            routing: Default::default(),
            limits: Limits::default(),
            tools: Vec::new(),
        }
    }

    #[tokio::test]
    async fn the_graphs_sampling_defaults_sit_over_the_models_and_under_the_request() {
        let cfg: PreprocessConfig = serde_json::from_value(serde_json::json!(
            {"defaults": {"temperature": 0.2, "top_p": 0.9, "max_tokens": 7}}
        ))
        .unwrap();
        assert!(cfg.validate().is_empty());
        let mut p = pre();
        let model = GenerationDefaults {
            temperature: Some(0.6),
            top_k: Some(50),
            ..GenerationDefaults::default()
        };
        p.defaults = cfg.defaults.over(&model);
        let out = p.preprocess(chat("hi")).await.expect("ok");
        let s = &out.sampling;
        assert_eq!(
            (s.temperature, s.top_p, s.top_k),
            (Some(0.2), Some(0.9), Some(50))
        );
        assert_eq!(out.stop.max_tokens, 7);
        let mut own = chat("hi");
        own.sampling.temperature = Some(0.0);
        own.limits.max_tokens = Some(3);
        let out = p.preprocess(own).await.expect("ok");
        assert_eq!(out.sampling.temperature, Some(0.0));
        assert_eq!(out.stop.max_tokens, 3);
        // Out-of-range defaults are configuration errors, named by field.
        let bad: PreprocessConfig = serde_json::from_value(serde_json::json!(
            {"defaults": {"temperature": 3.0, "top_p": 0, "top_k": 0}}
        ))
        .unwrap();
        let fields: Vec<_> = bad.validate().into_iter().filter_map(|i| i.field).collect();
        assert_eq!(
            fields,
            ["defaults.temperature", "defaults.top_p", "defaults.top_k"]
        );
    }

    /// A request for what the workers cannot serve is refused in the check, naming the
    /// parameter; what they may serve (a capability unknown) passes.
    #[tokio::test]
    async fn what_no_worker_can_serve_is_refused_where_the_request_is_checked() {
        let mut p = pre();
        p.serves = dyn_core::planes::Capabilities {
            logprobs: Some(false),
            embeddings: Some(false),
            grammars: Some(false),
            lora: Some(false),
        };
        let param = |e: OpError| e.param.expect("names its parameter");
        let mut r = chat("hi");
        r.sampling.logprobs = Some(2);
        assert_eq!(param(p.preprocess(r).await.unwrap_err()), "logprobs");
        let mut r = chat("hi");
        r.sampling.embed = Some(dyn_protocol::types::Pooling::Mean);
        assert_eq!(param(p.preprocess(r).await.unwrap_err()), "model");
        let mut r = chat("hi");
        r.sampling.constraint = Some(dyn_protocol::types::Constraint::JsonObject);
        assert_eq!(param(p.preprocess(r).await.unwrap_err()), "response_format");
        let mut r = chat("hi");
        r.routing.lora = Some(dyn_protocol::types::LoraRef {
            name: "a".into(),
            path: "/a".into(),
            id: 1,
        });
        assert_eq!(param(p.preprocess(r).await.unwrap_err()), "model");
        p.serves.logprobs = None;
        let mut r = chat("hi");
        r.sampling.logprobs = Some(2);
        assert!(p.preprocess(r).await.is_ok());
    }

    #[tokio::test]
    async fn chat_template_renders_headers_and_generation_prompt() {
        let p = pre();
        let text = p
            .render_with(&[ChatMessage::text("user", " hi ")], &[], true)
            .expect("render");
        assert_eq!(
            text,
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        );
        let out = p.preprocess(chat(" hi ")).await.expect("ok");
        let bos = p.model.tokenizer.token_to_id("<|begin_of_text|>");
        // One bos from the template, none added by the tokenizer.
        assert_eq!(out.token_ids.first().copied(), bos);
        assert_eq!(out.token_ids.iter().filter(|&&t| Some(t) == bos).count(), 1);
        assert_eq!(out.stop.max_tokens, 4096 - out.output.prompt_tokens);
    }

    #[tokio::test]
    async fn completions_get_bos_from_the_tokenizer() {
        let p = pre();
        let mut req = chat("");
        req.endpoint = Endpoint::Completion;
        req.prompt = Prompt::Text("Hello".into());
        let out = p.preprocess(req).await.expect("ok");
        assert_eq!(
            out.token_ids.first().copied(),
            p.model.tokenizer.token_to_id("<|begin_of_text|>")
        );
    }

    #[tokio::test]
    async fn bad_parameters_name_their_field() {
        let p = pre();
        type Edit = Box<dyn Fn(&mut LlmRequest)>;
        let cases: Vec<(Edit, &str)> = vec![
            (
                Box::new(|r| r.sampling.temperature = Some(3.0)),
                "temperature",
            ),
            (Box::new(|r| r.sampling.top_p = Some(0.0)), "top_p"),
            (Box::new(|r| r.limits.max_tokens = Some(0)), "max_tokens"),
            (Box::new(|r| r.limits.max_tokens = Some(5000)), "max_tokens"),
            (
                Box::new(|r| {
                    r.limits.min_tokens = Some(9);
                    r.limits.max_tokens = Some(3)
                }),
                "min_tokens",
            ),
            (Box::new(|r| r.limits.stop = vec![String::new()]), "stop"),
            (
                Box::new(|r| r.prompt = Prompt::Messages(vec![])),
                "messages",
            ),
            (
                Box::new(|r| r.prompt = Prompt::Tokens(vec![1, 999_999])),
                "prompt",
            ),
            (
                Box::new(|r| {
                    r.prompt =
                        Prompt::Messages(vec![ChatMessage::text("user", &"word ".repeat(5000))])
                }),
                "messages",
            ),
        ];
        for (edit, param) in cases {
            let mut req = chat("hi");
            edit(&mut req);
            let e = p.preprocess(req).await.expect_err(param);
            assert_eq!(e.kind, dyn_core::ErrorKind::InvalidRequest, "{param}: {e}");
            assert_eq!(e.param.as_deref(), Some(param), "{e}");
        }
    }

    /// A conversation's turns tokenized through the prefix cache give the tokens of a full
    /// render, turn after turn, on every chat template here (and SmolLM2's when the test run
    /// fetched it), and later turns find their prefix.
    #[tokio::test]
    async fn a_cached_conversation_prefix_gives_the_tokens_of_a_full_render() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models");
        let mut models = vec![dir.join("tiny"), dir.join("tiny-harmony")];
        match std::env::var_os("DYN_SMOLLM2_GGUF") {
            Some(p) if std::path::Path::new(&p).exists() => models.push(p.into()),
            _ => dyn_tests::skip("SmolLM2's template: DYN_SMOLLM2_GGUF is not set"),
        }
        let texts = [
            "Hello there! How are you today?",
            "  leading spaces, and a trailing newline\n",
            "code:\n```rust\nfn main() {\n    println!(\"{}\", 1 + 2);\n}\n```",
            "unicode: 日本語のテキスト, emoji 🙂👍🏽, combining e\u{301}",
            "numbers 0 12 345 6789 3.14159 and tabs\tand\r\nlines",
            "",
        ]
        // Long enough that a few turns go past the size from which prompts are cached.
        .map(|t| t.repeat(CACHED_PROMPT_BYTES / 8 / 40));
        for path in models {
            let mut m = ModelDir::load("m", &path).expect("loads");
            m.context_length = 1 << 20;
            let full = Preprocess::new(Arc::new(m)).expect("builds");
            let cached = Preprocess::new(full.model.clone())
                .expect("builds")
                .with_prefix_cache(1 << 20);
            let cache = cached
                .prefixes
                .clone()
                .expect("the tokenizer splits at added tokens");
            let mut messages = vec![ChatMessage::text("system", "Be brief.")];
            for turn in 0..12 {
                messages.push(ChatMessage::text("user", &texts[turn % texts.len()]));
                let want = full
                    .tokenize(Prompt::Messages(messages.clone()), &[], None, true)
                    .await
                    .expect("renders");
                let got = cached
                    .tokenize_in(
                        &[b"tenant"],
                        Prompt::Messages(messages.clone()),
                        &[],
                        None,
                        true,
                    )
                    .await
                    .expect("renders");
                assert_eq!(got, want, "{}: turn {turn}", path.display());
                messages.push(ChatMessage::text(
                    "assistant",
                    &texts[(turn + 3) % texts.len()],
                ));
            }
            let (entries, tokens) = cache.held();
            assert!(
                entries >= 8 && tokens > 0,
                "{}: {entries} entries",
                path.display()
            );
            // Another tenant's conversation does not start from this one's prefix.
            let keys = cache.keys(&[b"other", b"[]", &[1]], &messages[..messages.len() - 1]);
            let text = cached
                .render_with(&messages[..messages.len() - 1], &[], true)
                .unwrap();
            assert!(cache.lookup(&keys, &text).is_none());
            let keys = cache.keys(&[b"tenant", b"[]", &[1]], &messages[..messages.len() - 1]);
            let hit = cache
                .lookup(&keys, &text)
                .expect("the conversation's prefix");
            // Later turns' entries share the pieces earlier turns kept, not copies of them.
            assert!(hit.tokens.pieces() > 1, "{}", path.display());
        }
    }
}
