//! What dyn sends each kind of server and how it reads the streamed answer.
//!
//! vLLM: `/v1/completions` with the prompt as token ids and `return_token_ids`, so each chunk
//! carries the ids it adds. llama.cpp: its native `/completion` with a token array and
//! `return_tokens`. A generic OpenAI server: `/v1/completions` with the prompt decoded to text;
//! its text comes back and dyn tokenizes it again. Sampling parameters go through as the
//! request resolved them (preprocess already applied the model's defaults), so every server
//! samples the same way dyn's own engines do. vLLM and llama.cpp also return each token's
//! log-probability and top alternatives by id (vLLM's `logprobs` with
//! `return_tokens_as_token_ids`, llama.cpp's `n_probs`), from the model's distribution before
//! sampling, as dyn's native engine reports them.

use dyn_protocol::types::{Constraint, FinishReason, PreprocessedRequest, TokenLogprob};
use serde_json::{Map, Value, json};

use super::config::ExternalKind;

/// One call to a server.
pub struct Call {
    pub path: &'static str,
    pub body: Value,
}

/// What one call asks for; a request may take two (llama.cpp's `min_tokens`).
pub struct Ask<'a> {
    pub model: &'a str,
    /// llama.cpp: the adapters applied, by id and scale (its `lora` field).
    pub lora: Option<&'a Value>,
    /// Token ids (vLLM, llama.cpp) or text (OpenAI) to continue.
    pub prompt: Prompt<'a>,
    pub max_tokens: u32,
    /// No stop token ends the output before this many tokens (vLLM, OpenAI).
    pub min_tokens: u32,
    pub ignore_eos: bool,
}

pub enum Prompt<'a> {
    Tokens(&'a [u32]),
    Text(String),
}

impl Prompt<'_> {
    fn value(&self) -> Value {
        match self {
            Prompt::Tokens(t) => json!(t),
            Prompt::Text(s) => json!(s),
        }
    }
}

/// The call for `req`; `Err((param, why))` for what the server's dialect cannot say (a
/// structured output, stop token ids).
pub fn request(
    kind: ExternalKind,
    req: &PreprocessedRequest,
    ask: &Ask<'_>,
) -> Result<Call, (&'static str, String)> {
    let s = &req.sampling;
    if s.prompt_logprobs.is_some() {
        return Err((
            "logprobs",
            "a prompt's log-probabilities (echo) need a native worker".into(),
        ));
    }
    if s.logprobs.is_some() && kind == ExternalKind::Openai {
        return Err((
            "logprobs",
            "log-probabilities come from native, vLLM and llama.cpp workers; this worker's server is none of them"
                .into(),
        ));
    }
    let mut body = Map::new();
    let mut put = |k: &str, v: Value| {
        body.insert(k.to_owned(), v);
    };
    put("stream", json!(true));
    put("prompt", ask.prompt.value());
    match kind {
        ExternalKind::Vllm | ExternalKind::Openai => {
            put("model", json!(ask.model));
            put("max_tokens", json!(ask.max_tokens));
            if let Some(t) = s.temperature {
                put("temperature", json!(t));
            }
            if let Some(p) = s.top_p {
                put("top_p", json!(p));
            }
            if let Some(seed) = s.seed {
                put("seed", json!(seed));
            }
            // Extensions of vLLM (and SGLang): sent to other servers only when set, since
            // OpenAI itself refuses unknown parameters.
            if let Some(k) = s.top_k {
                put("top_k", json!(k));
            }
            if ask.min_tokens > 0 {
                put("min_tokens", json!(ask.min_tokens));
            }
            if ask.ignore_eos {
                put("ignore_eos", json!(true));
            }
            if let Some(c) = &s.constraint {
                put("structured_outputs", vllm_constraint(c));
            }
            for (k, v) in [
                ("presence_penalty", s.presence_penalty),
                ("frequency_penalty", s.frequency_penalty),
                ("repetition_penalty", s.repetition_penalty),
                ("min_p", s.min_p),
            ] {
                if let Some(v) = v {
                    put(k, json!(v));
                }
            }
            if !s.logit_bias.is_empty() {
                let bias: Map<String, Value> = s
                    .logit_bias
                    .iter()
                    .map(|(t, b)| (t.to_string(), json!(b)))
                    .collect();
                put("logit_bias", Value::Object(bias));
            }
            if kind == ExternalKind::Vllm {
                put("return_token_ids", json!(true));
                // vLLM's own field: its prefix cache keeps salted prompts apart too.
                if let Some(salt) = &req.routing.cache_salt {
                    put("cache_salt", json!(salt));
                }
                if let Some(n) = s.logprobs {
                    put("logprobs", json!(n));
                    put("return_tokens_as_token_ids", json!(true));
                }
                // The model's eos ids as dyn knows them (config, generation config,
                // tokenizer), not only the one vLLM reads, and the client's.
                let stop = req.stop.stop_tokens(ask.ignore_eos);
                if !stop.is_empty() {
                    put("stop_token_ids", json!(stop));
                }
            } else if !req.stop.stop_token_ids.is_empty() {
                return Err((
                    "stop_token_ids",
                    "stop_token_ids: this worker's OpenAI server does not take them".into(),
                ));
            }
            Ok(Call {
                path: "/v1/completions",
                body: Value::Object(body),
            })
        }
        ExternalKind::Llamacpp => {
            put("n_predict", json!(ask.max_tokens));
            if let Some(l) = ask.lora {
                put("lora", l.clone());
            }
            put("return_tokens", json!(true));
            if let Some(n) = s.logprobs {
                // With 0 it would send none at all: one, left out again when read.
                put("n_probs", json!(n.max(1)));
            }
            put("cache_prompt", json!(true));
            put("ignore_eos", json!(ask.ignore_eos));
            // llama.cpp's own defaults (top_k 40, top_p 0.95, min_p 0.05, temperature 0.8)
            // are not the OpenAI ones: say every parameter.
            let drawn = s.drawn();
            put("temperature", json!(drawn.temperature));
            put("top_p", json!(drawn.top_p));
            put("top_k", json!(drawn.top_k));
            put("min_p", json!(drawn.min_p));
            if let Some(seed) = s.seed {
                put("seed", json!(seed));
            }
            // Its penalties (off by default there too), over the request's whole context:
            // `repeat_last_n` its prompt and answer (this server refuses -1, "all").
            if s.penalized() {
                put("repeat_penalty", json!(drawn.repetition));
                put(
                    "repeat_last_n",
                    json!(req.token_ids.len() as u64 + u64::from(ask.max_tokens)),
                );
                put("presence_penalty", json!(drawn.presence));
                put("frequency_penalty", json!(drawn.frequency));
            }
            if !s.logit_bias.is_empty() {
                put("logit_bias", json!(s.logit_bias));
            }
            if !req.stop.stop_token_ids.is_empty() {
                return Err((
                    "stop_token_ids",
                    "stop_token_ids: llama.cpp's server does not take them".into(),
                ));
            }
            if let Some(c) = &s.constraint {
                let param = match c {
                    Constraint::Calls(_) => "tool_choice",
                    _ => "response_format",
                };
                let (k, v) = llamacpp_constraint(c).map_err(|e| (param, e))?;
                put(k, v);
            }
            Ok(Call {
                path: "/completion",
                body: Value::Object(body),
            })
        }
    }
}

/// vLLM's `structured_outputs` (also what SGLang-style OpenAI servers read).
fn vllm_constraint(c: &Constraint) -> Value {
    match c {
        Constraint::JsonSchema(s) => json!({"json": s}),
        Constraint::JsonObject => json!({"json_object": true}),
        Constraint::Regex(r) => json!({"regex": r}),
        Constraint::Choice(o) => json!({"choice": o}),
        Constraint::Lark(g) => json!({"grammar": g}),
        Constraint::Calls(c) => json!({"grammar": dyn_llm::grammar::calls_lark(c)}),
    }
}

/// llama.cpp's `json_schema`, or a GBNF `grammar` for a choice or forced tool calls; it has
/// no regex or Lark.
fn llamacpp_constraint(c: &Constraint) -> Result<(&'static str, Value), String> {
    match c {
        Constraint::JsonSchema(s) => Ok(("json_schema", s.clone())),
        Constraint::JsonObject => Ok(("json_schema", json!({"type": "object"}))),
        // GBNF's own escapes: JSON's `\b` and `\f` are not GBNF.
        Constraint::Choice(o) => Ok(("grammar", json!(dyn_llm::gbnf::choice(o)))),
        Constraint::Calls(c) => dyn_llm::gbnf::calls(c)
            .map(|g| ("grammar", json!(g)))
            .map_err(|e| {
                format!("llama.cpp workers cannot force a call whose parameters use {e}; a native or vLLM worker can")
            }),
        Constraint::Regex(_) | Constraint::Lark(_) => Err(
            "llama.cpp workers take JSON schemas and choices; a regex or Lark grammar needs a native or vLLM worker"
                .into(),
        ),
    }
}

/// One streamed event, read.
#[derive(Debug, PartialEq)]
pub enum Chunk {
    /// Token ids, the finish reason, and (vLLM, when asked) each token's log-probability.
    Tokens(Vec<u32>, Option<FinishReason>, Vec<TokenLogprob>),
    Text(String, Option<FinishReason>),
    /// Nothing for the client (a usage-only chunk).
    Nothing,
}

/// One event's data; `top`: the alternatives asked for with each log-probability.
pub fn parse(kind: ExternalKind, data: &str, top: usize) -> Result<Chunk, String> {
    let v: Value = serde_json::from_str(data).map_err(|e| format!("unreadable chunk: {e}"))?;
    if let Some(e) = v.get("error") {
        let msg = e
            .get("message")
            .and_then(Value::as_str)
            .map_or_else(|| e.to_string(), str::to_owned);
        return Err(format!("the engine failed the request: {msg}"));
    }
    let ids = |v: Option<&Value>| -> Result<Vec<u32>, String> {
        let Some(Value::Array(a)) = v else {
            return Ok(Vec::new());
        };
        a.iter()
            .map(|t| {
                t.as_u64()
                    .and_then(|t| u32::try_from(t).ok())
                    .ok_or_else(|| format!("token id {t} out of range"))
            })
            .collect()
    };
    match kind {
        ExternalKind::Vllm | ExternalKind::Openai => {
            let Some(choice) = v.get("choices").and_then(|c| c.get(0)) else {
                return Ok(Chunk::Nothing);
            };
            let finish = match choice.get("finish_reason").and_then(Value::as_str) {
                None => None,
                Some("length") => Some(FinishReason::Length),
                Some("abort") => return Err("the engine aborted the request".into()),
                Some(_) => Some(FinishReason::Stop),
            };
            if kind == ExternalKind::Vllm {
                if choice.get("token_ids").is_none_or(Value::is_null) && finish.is_none() {
                    return Err("the server sent no token ids: is it vLLM 0.10.2 or later?".into());
                }
                let ids = ids(choice.get("token_ids"))?;
                let lps = match choice.get("logprobs") {
                    Some(l @ Value::Object(_)) => vllm_logprobs(l, &ids, top)?,
                    _ => Vec::new(),
                };
                Ok(Chunk::Tokens(ids, finish, lps))
            } else {
                let text = choice.get("text").and_then(Value::as_str).unwrap_or("");
                Ok(Chunk::Text(text.to_owned(), finish))
            }
        }
        ExternalKind::Llamacpp => {
            let stop = v.get("stop").and_then(Value::as_bool).unwrap_or(false);
            let finish = stop.then(|| match v.get("stop_type").and_then(Value::as_str) {
                Some("limit") => FinishReason::Length,
                _ => FinishReason::Stop,
            });
            let ids = ids(v.get("tokens"))?;
            let lps = match v.get("completion_probabilities") {
                Some(Value::Array(p)) => llamacpp_logprobs(p, &ids, top)?,
                _ => Vec::new(),
            };
            Ok(Chunk::Tokens(ids, finish, lps))
        }
    }
}

/// llama.cpp's `completion_probabilities` (`{id, logprob, top_logprobs: [{id, logprob}]}` per
/// token), one per token of `ids`, `asked` alternatives each.
fn llamacpp_logprobs(p: &[Value], ids: &[u32], asked: usize) -> Result<Vec<TokenLogprob>, String> {
    if p.len() != ids.len() {
        return Err(format!(
            "{} log-probabilities for {} tokens",
            p.len(),
            ids.len()
        ));
    }
    let one = |v: &Value| -> Result<(u32, f32), String> {
        let id = v
            .get("id")
            .and_then(Value::as_u64)
            .and_then(|t| u32::try_from(t).ok())
            .ok_or_else(|| format!("a log-probability without a token id: {v}"))?;
        let lp = v
            .get("logprob")
            .and_then(Value::as_f64)
            .unwrap_or(f64::NEG_INFINITY);
        Ok((id, lp as f32))
    };
    p.iter()
        .zip(ids)
        .map(|(e, &token)| {
            let (_, logprob) = one(e)?;
            let mut top = e
                .get("top_logprobs")
                .and_then(Value::as_array)
                .map(|a| a.iter().map(one).collect::<Result<Vec<_>, _>>())
                .transpose()?
                .unwrap_or_default();
            top.truncate(asked);
            Ok(TokenLogprob {
                token,
                logprob,
                top,
            })
        })
        .collect()
}

/// `token_id:123` (vLLM's `return_tokens_as_token_ids`) as 123.
fn token_id(s: &str) -> Result<u32, String> {
    s.strip_prefix("token_id:")
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| format!("a log-probability names {s:?}, not a token id"))
}

/// A completions chunk's `logprobs` (`token_logprobs`, `top_logprobs` maps from token to
/// log-probability), one per token of `ids`; the alternatives best first, `asked` of them
/// (the map adds the sampled token when it is not among them).
fn vllm_logprobs(l: &Value, ids: &[u32], asked: usize) -> Result<Vec<TokenLogprob>, String> {
    let list = |k: &str| {
        l.get(k)
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default()
    };
    let (lps, tops) = (list("token_logprobs"), list("top_logprobs"));
    if lps.len() != ids.len() {
        return Err(format!(
            "{} log-probabilities for {} tokens",
            lps.len(),
            ids.len()
        ));
    }
    ids.iter()
        .enumerate()
        .map(|(i, &token)| {
            let mut top = Vec::new();
            if let Some(m) = tops.get(i).and_then(Value::as_object) {
                for (k, v) in m {
                    top.push((token_id(k)?, v.as_f64().unwrap_or(f64::NEG_INFINITY) as f32));
                }
            }
            top.sort_by(|a, b| b.1.total_cmp(&a.1));
            top.truncate(asked);
            Ok(TokenLogprob {
                token,
                logprob: lps[i].as_f64().unwrap_or(f64::NEG_INFINITY) as f32,
                top,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req() -> PreprocessedRequest {
        let mut r = dyn_protocol::testing::preprocessed(vec![1, 2, 3], 8);
        r.stop.eos_token_ids = vec![2, 0];
        r.sampling.temperature = Some(0.0);
        r
    }

    fn ask(prompt: Prompt<'_>) -> Ask<'_> {
        Ask {
            model: "m",
            lora: None,
            prompt,
            max_tokens: 8,
            min_tokens: 2,
            ignore_eos: false,
        }
    }

    #[test]
    fn vllm_gets_token_ids_and_dyns_stop_tokens() {
        let r = req();
        let c =
            request(ExternalKind::Vllm, &r, &ask(Prompt::Tokens(&r.token_ids))).expect("a call");
        assert_eq!(c.path, "/v1/completions");
        assert_eq!(
            c.body,
            json!({"model": "m", "prompt": [1, 2, 3], "max_tokens": 8, "min_tokens": 2, "temperature": 0.0,
                   "seed": 5, "stream": true, "return_token_ids": true, "stop_token_ids": [2, 0]})
        );
        let chunk =
            r#"{"choices":[{"index":0,"text":"x","finish_reason":null,"token_ids":[7,8]}]}"#;
        assert_eq!(
            parse(ExternalKind::Vllm, chunk, 0),
            Ok(Chunk::Tokens(vec![7, 8], None, vec![]))
        );
        let last = r#"{"choices":[{"text":"","finish_reason":"length","token_ids":[9]}]}"#;
        assert_eq!(
            parse(ExternalKind::Vllm, last, 0),
            Ok(Chunk::Tokens(vec![9], Some(FinishReason::Length), vec![]))
        );
        assert_eq!(
            parse(ExternalKind::Vllm, r#"{"choices":[],"usage":{}}"#, 0),
            Ok(Chunk::Nothing)
        );
        let e = parse(ExternalKind::Vllm, r#"{"error":{"message":"too long"}}"#, 0).unwrap_err();
        assert!(e.ends_with("too long"), "{e}");
        let e = parse(ExternalKind::Vllm, r#"{"choices":[{"text":"x"}]}"#, 0).unwrap_err();
        assert!(e.contains("no token ids"), "{e}");
    }

    #[test]
    fn vllm_gives_log_probabilities_by_token_id() {
        let mut r = req();
        r.sampling.logprobs = Some(2);
        let c =
            request(ExternalKind::Vllm, &r, &ask(Prompt::Tokens(&r.token_ids))).expect("a call");
        assert_eq!(c.body["logprobs"], 2);
        assert_eq!(c.body["return_tokens_as_token_ids"], true);
        // The sampled token (9) is not among the two best at the second position: vLLM adds
        // it to the map, and it is not an alternative.
        let chunk = r#"{"choices":[{"text":"ab","finish_reason":null,"token_ids":[7,9],"logprobs":{
            "tokens":["token_id:7","token_id:9"],"token_logprobs":[-0.1,-3.5],"text_offset":[0,1],
            "top_logprobs":[{"token_id:7":-0.1,"token_id:4":-2.5},
                            {"token_id:1":-0.2,"token_id:9":-3.5,"token_id:3":-1.9}]}}]}"#;
        let lp = |token, logprob, top: Vec<(u32, f32)>| TokenLogprob {
            token,
            logprob,
            top,
        };
        assert_eq!(
            parse(ExternalKind::Vllm, chunk, 2),
            Ok(Chunk::Tokens(
                vec![7, 9],
                None,
                vec![
                    lp(7, -0.1, vec![(7, -0.1), (4, -2.5)]),
                    lp(9, -3.5, vec![(1, -0.2), (3, -1.9)])
                ]
            ))
        );
        // llama.cpp: `n_probs`, and its `completion_probabilities`.
        let c = request(
            ExternalKind::Llamacpp,
            &r,
            &ask(Prompt::Tokens(&r.token_ids)),
        );
        assert_eq!(c.expect("a call").body["n_probs"], 2);
        let chunk = r#"{"content":" Paris","tokens":[7042],"stop":false,"completion_probabilities":[
            {"id":7042,"token":" Paris","logprob":-0.25,"top_logprobs":[{"id":7042,"logprob":-0.25},
             {"id":260,"logprob":-2.75}]}]}"#;
        assert_eq!(
            parse(ExternalKind::Llamacpp, chunk, 1),
            Ok(Chunk::Tokens(
                vec![7042],
                None,
                vec![lp(7042, -0.25, vec![(7042, -0.25)])]
            ))
        );
        // A generic OpenAI server, or a prompt's log-probabilities: a 400 naming the field.
        let e = request(ExternalKind::Openai, &r, &ask(Prompt::Text("x".into())));
        assert_eq!(e.err().map(|e| e.0), Some("logprobs"));
        r.sampling.prompt_logprobs = Some(1);
        let e = request(ExternalKind::Vllm, &r, &ask(Prompt::Tokens(&r.token_ids)));
        assert_eq!(e.err().map(|e| e.0), Some("logprobs"));
    }

    #[test]
    fn structured_outputs_go_in_each_servers_dialect() {
        let mut r = req();
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        r.sampling.constraint = Some(Constraint::JsonSchema(schema.clone()));
        let a = ask(Prompt::Tokens(&r.token_ids));
        let vllm = request(ExternalKind::Vllm, &r, &a).expect("a call");
        assert_eq!(vllm.body["structured_outputs"], json!({"json": schema}));
        let cpp = request(ExternalKind::Llamacpp, &r, &a).expect("a call");
        assert_eq!(cpp.body["json_schema"], schema);
        r.sampling.constraint = Some(Constraint::Choice(vec!["yes".into(), "no \"x\"".into()]));
        let cpp = request(ExternalKind::Llamacpp, &r, &a).expect("a call");
        assert_eq!(cpp.body["grammar"], json!(r#"root ::= "yes" | "no \"x\"""#));
        r.sampling.constraint = Some(Constraint::Regex("[a-z]+".into()));
        let e = request(ExternalKind::Llamacpp, &r, &a)
            .err()
            .expect("no regex in llama.cpp");
        assert_eq!(e.0, "response_format");
        assert!(e.1.contains("regex"), "{e:?}");
        let vllm = request(ExternalKind::Vllm, &r, &a).expect("a call");
        assert_eq!(vllm.body["structured_outputs"], json!({"regex": "[a-z]+"}));
    }

    #[test]
    fn penalties_bias_min_p_and_stop_tokens_go_in_each_servers_dialect() {
        let mut r = req();
        r.sampling.presence_penalty = Some(0.5);
        r.sampling.frequency_penalty = Some(-0.25);
        r.sampling.repetition_penalty = Some(1.1);
        r.sampling.min_p = Some(0.05);
        r.sampling.logit_bias = vec![(3, -100.0), (17, 2.5)];
        let a = ask(Prompt::Tokens(&r.token_ids));
        let v = request(ExternalKind::Vllm, &r, &a).expect("a call").body;
        assert_eq!(
            (
                &v["presence_penalty"],
                &v["frequency_penalty"],
                &v["repetition_penalty"],
                &v["min_p"]
            ),
            (&json!(0.5), &json!(-0.25), &json!(1.1f32), &json!(0.05f32))
        );
        assert_eq!(v["logit_bias"], json!({"3": -100.0, "17": 2.5}));
        let c = request(ExternalKind::Llamacpp, &r, &a)
            .expect("a call")
            .body;
        assert_eq!(c["repeat_penalty"], json!(1.1f32));
        assert_eq!(c["repeat_last_n"], json!(r.token_ids.len() + 8));
        assert_eq!(c["min_p"], json!(0.05f32));
        assert_eq!(c["logit_bias"], json!([[3, -100.0], [17, 2.5]]));
        // Stop tokens: vLLM gets them after the model's eos ids; llama.cpp cannot say them.
        r.stop.stop_token_ids = vec![42];
        let v = request(ExternalKind::Vllm, &r, &a).expect("a call").body;
        let mut want = r.stop.eos_token_ids.clone();
        want.push(42);
        assert_eq!(v["stop_token_ids"], json!(want));
        let e = request(ExternalKind::Llamacpp, &r, &a)
            .err()
            .expect("refused");
        assert_eq!(e.0, "stop_token_ids");
    }

    #[test]
    fn llamacpp_gets_every_sampling_parameter_and_its_native_stream_is_read() {
        let r = req();
        let c = request(
            ExternalKind::Llamacpp,
            &r,
            &ask(Prompt::Tokens(&r.token_ids)),
        )
        .expect("a call");
        assert_eq!(c.path, "/completion");
        assert_eq!(
            c.body,
            json!({"prompt": [1, 2, 3], "n_predict": 8, "stream": true, "return_tokens": true, "cache_prompt": true,
                   "ignore_eos": false, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": 5})
        );
        // An adapter applied goes in its `lora` field, as the worker found it in the list.
        let applied = json!([{"id": 1, "scale": 1.0}]);
        let with = Ask {
            lora: Some(&applied),
            ..ask(Prompt::Tokens(&r.token_ids))
        };
        let c = request(ExternalKind::Llamacpp, &r, &with).expect("a call");
        assert_eq!(c.body["lora"], applied);
        assert_eq!(
            parse(
                ExternalKind::Llamacpp,
                r#"{"content":"a","tokens":[79],"stop":false}"#,
                0
            ),
            Ok(Chunk::Tokens(vec![79], None, vec![]))
        );
        assert_eq!(
            parse(
                ExternalKind::Llamacpp,
                r#"{"content":"","tokens":[],"stop":true,"stop_type":"limit"}"#,
                0
            ),
            Ok(Chunk::Tokens(vec![], Some(FinishReason::Length), vec![]))
        );
        assert_eq!(
            parse(
                ExternalKind::Llamacpp,
                r#"{"tokens":[],"stop":true,"stop_type":"eos"}"#,
                0
            ),
            Ok(Chunk::Tokens(vec![], Some(FinishReason::Stop), vec![]))
        );
    }

    #[test]
    fn an_openai_server_gets_text_and_only_standard_fields_unless_set() {
        let mut r = req();
        r.sampling.seed = None;
        let a = Ask {
            min_tokens: 0,
            ..ask(Prompt::Text("hi".into()))
        };
        let c = request(ExternalKind::Openai, &r, &a).expect("a call");
        assert_eq!(
            c.body,
            json!({"model": "m", "prompt": "hi", "max_tokens": 8, "temperature": 0.0, "stream": true})
        );
        assert_eq!(
            parse(
                ExternalKind::Openai,
                r#"{"choices":[{"text":" there","finish_reason":"stop"}]}"#,
                0
            ),
            Ok(Chunk::Text(" there".into(), Some(FinishReason::Stop)))
        );
    }
}
