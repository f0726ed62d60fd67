//! `postprocess`: turns an engine's token stream into text deltas.
//!
//! The engine's first item ([`Generated::Start`]) carries what this node needs to know about
//! the request (prompt length, stop strings, `min_tokens`). Each token batch is detokenized
//! incrementally and passed through the stop-string matcher; a matched stop string ends the
//! response with `finish_reason: stop` and is not sent. Ending early simply drops the engine's
//! stream, which is what tells the engine to free the request. The last delta carries usage.
//!
//! ```yaml
//! postprocess: {kind: postprocess, inputs: [decode]}
//! ```

use std::sync::Arc;

use dyn_core::{BuildCx, BuildError, Ctx, Input, OpError, Operator, OperatorConfig, Output};
use futures::StreamExt;
use serde::Deserialize;
use tokenizers::Tokenizer;

use super::detok::{Detokenizer, Matched, StopMatcher, TokenBytes};
use super::model::ModelDir;
use dyn_protocol::types::{FinishReason, Generated, LlmDelta, TextLogprob, TokenLogprob, Usage};

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PostprocessConfig {}

impl OperatorConfig for PostprocessConfig {
    const KIND: &'static str = "postprocess";
    const SUMMARY: &'static str =
        "Detokenizes incrementally, applies stop strings, reports finish reason and usage";
    type Op = Postprocess;

    async fn build(&self, cx: &BuildCx) -> Result<Postprocess, BuildError> {
        let model = ModelDir::shared(cx).await?;
        Ok(Postprocess {
            tokenizer: model.tokenizer.clone(),
            bytes: model.token_bytes.clone(),
        })
    }
}

pub struct Postprocess {
    tokenizer: Arc<Tokenizer>,
    /// Byte-level tokenizers: each token's bytes, so detokenizing needs no decode call.
    bytes: Option<Arc<TokenBytes>>,
}

impl Postprocess {
    pub fn new(tokenizer: Arc<Tokenizer>) -> Self {
        let bytes = TokenBytes::new(&tokenizer).map(Arc::new);
        Self { tokenizer, bytes }
    }
}

/// A token as a client sees it in a log-probability: its bytes from the byte table, or (special
/// tokens, other tokenizers) as the tokenizer decodes it alone, special tokens kept.
fn token_text(tokenizer: &Tokenizer, bytes: Option<&TokenBytes>, id: u32) -> (String, Vec<u8>) {
    match bytes.map(|b| b.get(id)).filter(|b| !b.is_empty()) {
        Some(b) => (String::from_utf8_lossy(b).into_owned(), b.to_vec()),
        None => {
            let s = tokenizer.decode(&[id], false).unwrap_or_default();
            let b = s.as_bytes().to_vec();
            (s, b)
        }
    }
}

/// The engine's log-probabilities in the client's terms: the item's tokens', and the prompt's
/// (the first token without one) when the item carries them.
fn texts(
    tokenizer: &Tokenizer,
    bytes: Option<&TokenBytes>,
    l: dyn_protocol::types::Logprobs,
) -> (Vec<TextLogprob>, Vec<TextLogprob>) {
    let one = |t: &TokenLogprob| {
        let (token, b) = token_text(tokenizer, bytes, t.token);
        TextLogprob {
            token,
            bytes: b,
            logprob: Some(t.logprob),
            top: t
                .top
                .iter()
                .map(|&(id, lp)| {
                    let (s, b) = token_text(tokenizer, bytes, id);
                    (s, b, lp)
                })
                .collect(),
        }
    };
    let mut prompt = Vec::new();
    if let Some(first) = l.prompt_first {
        let (token, b) = token_text(tokenizer, bytes, first);
        prompt.push(TextLogprob {
            token,
            bytes: b,
            logprob: None,
            top: Vec::new(),
        });
        prompt.extend(l.prompt.iter().map(one));
    }
    (l.tokens.iter().map(one).collect(), prompt)
}

fn detok_error(e: tokenizers::Error) -> OpError {
    OpError::internal(format!("detokenizer: {e}"))
}

impl Operator for Postprocess {
    type In = Generated;
    type Out = LlmDelta;

    fn call(&self, ctx: Ctx, mut input: Input<Generated>) -> Output<LlmDelta> {
        let tokenizer = self.tokenizer.clone();
        let bytes = self.bytes.clone();
        async_stream::try_stream! {
            let spec = match input.next().await {
                Some(Generated::Start(spec)) => spec,
                Some(Generated::Tokens { .. }) => Err(OpError::internal("engine stream did not start with its request spec"))?,
                // The engine ended without a word: its error, if any, reaches the ingress.
                None => return,
            };
            let mut detok = match &bytes {
                Some(table) => Detokenizer::with_bytes(tokenizer.clone(), table.clone()),
                None => Detokenizer::new(tokenizer.clone()),
            }
            .keeping_special(spec.keep_special);
            let mut stops = StopMatcher::new(spec.stop.clone());
            let mut prompt_sent = false;
            let usage = |tokens: usize| Usage {
                prompt_tokens: spec.prompt_tokens,
                completion_tokens: u32::try_from(tokens).unwrap_or(u32::MAX),
            };
            while let Some(item) = input.next().await {
                let Generated::Tokens { ids, finish, logprobs, embedding } = item else {
                    Err(OpError::internal("engine sent a second request spec"))?;
                    continue;
                };
                if let Some(embedding) = embedding {
                    // An embeddings request: its vector is its answer.
                    yield LlmDelta { finish: Some(finish.unwrap_or(FinishReason::Stop)), usage: Some(usage(0)), embedding: Some(embedding), ..LlmDelta::default() };
                    return;
                }
                // With return_token_ids: the prompt's ids once, then each delta's own.
                let ids_out = spec.prompt_token_ids.is_some();
                let prompt_ids = if ids_out && !prompt_sent {
                    prompt_sent = true;
                    spec.prompt_token_ids.clone()
                } else {
                    None
                };
                let (mut token_lps, prompt_lps) = match logprobs {
                    Some(l) => texts(&tokenizer, bytes.as_deref(), *l),
                    None => (Vec::new(), Vec::new()),
                };
                let mut text = String::new();
                let mut stopped = false;
                let mut used = 0u32;
                let mut stop_token = 0;
                let n = ids.len();
                for (k, &id) in ids.iter().enumerate() {
                    used += 1;
                    if k + 1 == n && finish.is_some() && spec.stop_token_ids.contains(&id) {
                        // One of the request's stop tokens ends the answer without being part
                        // of it, as vLLM leaves it out (eos, a special token, has no text).
                        // (`length` too: a structured output its budget steered to eos.)
                        stop_token = 1;
                        break;
                    }
                    let piece = detok.push(id).map_err(detok_error)?;
                    let armed = detok.tokens() >= spec.min_tokens as usize;
                    match stops.feed(&piece, armed) {
                        Matched::Continue(t) => text.push_str(&t),
                        Matched::Stop(t) => {
                            text.push_str(&t);
                            stopped = true;
                            break;
                        }
                    }
                }
                if stopped {
                    tracing::debug!(request_id = %ctx.id(), "Stop string matched");
                    token_lps.truncate(used as usize);
                    yield LlmDelta { text, tokens: used, finish: Some(FinishReason::Stop), usage: Some(usage(detok.tokens() + stop_token)), logprobs: token_lps, prompt_logprobs: prompt_lps, token_ids: ids_out.then(|| ids[..used as usize].to_vec()), prompt_token_ids: prompt_ids, stop_string: stops.matched().map(str::to_owned), embedding: None };
                    return;
                }
                if let Some(finish) = finish {
                    let rest = detok.finish().map_err(detok_error)?;
                    let armed = detok.tokens() >= spec.min_tokens as usize;
                    let finish = match stops.feed(&rest, armed) {
                        Matched::Continue(t) => { text.push_str(&t); finish }
                        Matched::Stop(t) => { text.push_str(&t); FinishReason::Stop }
                    };
                    text.push_str(&stops.finish());
                    yield LlmDelta { text, tokens: used, finish: Some(finish), usage: Some(usage(detok.tokens() + stop_token)), logprobs: token_lps, prompt_logprobs: prompt_lps, token_ids: ids_out.then(|| ids.clone()), prompt_token_ids: prompt_ids, stop_string: stops.matched().map(str::to_owned), embedding: None };
                    return;
                }
                yield LlmDelta { text, tokens: used, finish: None, usage: None, logprobs: token_lps, prompt_logprobs: prompt_lps, token_ids: ids_out.then(|| ids.clone()), prompt_token_ids: prompt_ids, stop_string: None, embedding: None };
            }
            if !ctx.is_killed() {
                Err(OpError::internal("engine stream ended without a finish reason"))?;
            }
        }
        .boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dyn_protocol::types::OutputSpec;
    use futures::stream;

    async fn run(stop: &[&str], min_tokens: u32, text: &str) -> Vec<LlmDelta> {
        let tok = crate::model::tests::tiny().tokenizer;
        let ids = tok.encode(text, false).expect("encode").get_ids().to_vec();
        let n = ids.len();
        let mut items = vec![Generated::Start(OutputSpec {
            prompt_tokens: 7,
            min_tokens,
            stop: stop.iter().map(|s| s.to_string()).collect(),
            stop_token_ids: Vec::new(),
            prompt_token_ids: None,
            keep_special: false,
        })];
        for (i, id) in ids.into_iter().enumerate() {
            let finish = (i + 1 == n).then_some(FinishReason::Length);
            items.push(Generated::Tokens {
                embedding: None,
                ids: vec![id],
                finish,
                logprobs: None,
            });
        }
        Postprocess::new(tok)
            .call(Ctx::new(), stream::iter(items).boxed())
            .map(|r| r.expect("ok"))
            .collect()
            .await
    }

    fn text(d: &[LlmDelta]) -> String {
        d.iter().map(|d| d.text.as_str()).collect()
    }

    #[tokio::test]
    async fn runs_to_length_with_usage_on_the_last_delta() {
        let out = run(&[], 0, "The quick brown fox").await;
        assert_eq!(text(&out), "The quick brown fox");
        let last = out.last().expect("a delta");
        assert_eq!(last.finish, Some(FinishReason::Length));
        let n = out.iter().map(|d| d.tokens).sum::<u32>();
        assert_eq!(
            last.usage,
            Some(Usage {
                prompt_tokens: 7,
                completion_tokens: n
            })
        );
        assert!(
            out[..out.len() - 1]
                .iter()
                .all(|d| d.usage.is_none() && d.finish.is_none())
        );
    }

    #[tokio::test]
    async fn stop_string_ends_the_output_and_is_not_sent() {
        let out = run(&["brown"], 0, "The quick brown fox").await;
        assert_eq!(text(&out), "The quick ");
        assert_eq!(out.last().and_then(|d| d.finish), Some(FinishReason::Stop));
    }

    #[tokio::test]
    async fn min_tokens_defers_stop_strings() {
        let out = run(&["The"], 3, "The quick The fox").await;
        assert_eq!(text(&out), "The quick ");
    }

    #[tokio::test]
    async fn tokens_before_start_are_an_error() {
        let tok = crate::model::tests::tiny().tokenizer;
        let out: Vec<_> = Postprocess::new(tok)
            .call(
                Ctx::new(),
                stream::iter([Generated::Tokens {
                    embedding: None,
                    ids: vec![1],
                    finish: None,
                    logprobs: None,
                }])
                .boxed(),
            )
            .collect()
            .await;
        assert!(matches!(&out[..], [Err(e)] if e.kind == dyn_core::ErrorKind::Internal));
    }
}
