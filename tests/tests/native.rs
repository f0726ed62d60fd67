//! The native engine behind the real `dyn` binary and HTTP (`graphs/agg_native.yaml`):
//! greedy completions of the tiny random-weight Llama equal Hugging Face transformers'
//! reference tokens whether requests run alone or batched, a repeated prompt is served from
//! the prefix cache with the same answer, preempted sequences recompute to the same answer, a
//! request larger than the whole cache ends with `length` instead of hanging, seeded sampling
//! repeats, logit bias, min-p, penalties and stop tokens act, log-probabilities (of answers and
//! of echoed prompts) equal transformers' log-softmax, `n` choices share the prompt's
//! computation, and bad input is a 400.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is a failure report

use dyn_tests::{Graph, completion, metric, root};
use serde_json::{Value, json};

struct Case {
    prompt: Vec<u32>,
    greedy: Vec<u32>,
    /// Transformers' logits (f32) before each of the first greedy tokens.
    logits: Vec<Vec<f64>>,
}

fn reference() -> Vec<Case> {
    let text = std::fs::read_to_string(root().join("models/tiny/reference.json")).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    let ids = |x: &Value| -> Vec<u32> {
        x.as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect()
    };
    v["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Case {
            prompt: ids(&c["prompt"]),
            greedy: ids(&c["greedy"]),
            logits: serde_json::from_value(c["logits"].clone()).unwrap(),
        })
        .collect()
}

async fn complete(url: &str, body: Value) -> Value {
    let (status, v) = completion(url, &body).await;
    assert_eq!(status, 200, "{v}");
    v
}

/// The reference prompts' greedy answers as text.
fn want_texts(cases: &[Case]) -> Vec<String> {
    let tok = tokenizers::Tokenizer::from_file(root().join("models/tiny/tokenizer.json")).unwrap();
    cases
        .iter()
        .map(|c| tok.decode(&c.greedy, true).unwrap())
        .collect()
}

/// Every reference prompt `rounds` times, all at once; each answer must be the reference's.
async fn all_at_once_match(url: &str, cases: &[Case], rounds: usize) {
    let want = want_texts(cases);
    let tasks: Vec<_> = (0..rounds)
        .flat_map(|_| cases.iter())
        .map(|c| {
            let (url, body) = (url.to_owned(), greedy_body(&c.prompt, c.greedy.len()));
            tokio::spawn(async move { complete(&url, body).await })
        })
        .collect();
    for (i, t) in tasks.into_iter().enumerate() {
        let v = t.await.unwrap();
        assert_eq!(
            v["choices"][0]["text"],
            want[i % cases.len()].as_str(),
            "{v}"
        );
    }
}

fn greedy_body(prompt: &[u32], max_tokens: usize) -> Value {
    json!({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
           "temperature": 0, "ignore_eos": true})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_output_equals_transformers_alone_batched_and_from_the_prefix_cache() {
    let g = Graph::up_with_ingress("graphs/agg_native.yaml", "http", &[]);
    let url = g.url("");
    let cases = reference();
    let want = want_texts(&cases);
    // Alone, one after another.
    for (c, w) in cases.iter().zip(&want) {
        let v = complete(&url, greedy_body(&c.prompt, c.greedy.len())).await;
        assert_eq!(v["choices"][0]["text"], w.as_str(), "{v}");
        assert_eq!(v["usage"]["completion_tokens"], c.greedy.len());
        assert_eq!(v["usage"]["prompt_tokens"], c.prompt.len());
    }
    // All at once, three times over: batched together (and by now from the prefix cache).
    all_at_once_match(&url, &cases, 3).await;
    let m = g.get("/metrics");
    let hits = metric(&m, &["dyn_worker_prefix_cache_hit_blocks_total"]);
    assert!(hits > 0, "repeated prompts hit the prefix cache:\n{m}");
}

/// `token`'s log-probability under logits (the definition: log-softmax).
fn log_softmax(logits: &[f64], token: usize) -> f64 {
    let max = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let lse = max + logits.iter().map(|l| (l - max).exp()).sum::<f64>().ln();
    logits[token] - lse
}

/// Log-probabilities against transformers: each greedy token's and its top 5 alternatives'
/// (completions), the same through the chat API, and a prompt's (echo) — the prompt is the
/// reference prompt followed by its greedy tokens, so its last positions' log-probabilities
/// are the greedy steps' again. And vLLM's `return_token_ids`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_log_probabilities_equal_transformers_log_softmax() {
    let g = Graph::up_with_ingress("graphs/agg_native.yaml", "http", &[]);
    let url = g.url("");
    for case in reference() {
        let steps = case.logits.len();
        let want: Vec<f64> = (0..steps)
            .map(|i| log_softmax(&case.logits[i], case.greedy[i] as usize))
            .collect();
        let close = |got: &Value, want: f64, what: &str| {
            let got = got.as_f64().unwrap();
            assert!((got - want).abs() < 1e-3, "{what}: {got} against {want}");
        };
        let mut body = greedy_body(&case.prompt, steps);
        body["logprobs"] = json!(5);
        let v = complete(&url, body).await;
        let lp = &v["choices"][0]["logprobs"];
        for i in 0..steps {
            close(&lp["token_logprobs"][i], want[i], &format!("step {i}"));
            // The top 5 are the five largest logits' (keyed by token text, so tokens that
            // are parts of one character share a key).
            let top = lp["top_logprobs"][i].as_object().unwrap();
            assert!((1..=5).contains(&top.len()), "{lp}");
            let mut best: Vec<f64> = (0..case.logits[i].len())
                .map(|t| log_softmax(&case.logits[i], t))
                .collect();
            best.sort_by(|a, b| b.total_cmp(a));
            for g in top.values() {
                let g = g.as_f64().unwrap();
                assert!(
                    best[..5].iter().any(|b| (g - b).abs() < 1e-3),
                    "{g} not in {best:?}"
                );
            }
            let most = top
                .values()
                .map(|x| x.as_f64().unwrap())
                .fold(f64::MIN, f64::max);
            close(&json!(most), best[0], "the most likely");
        }
        assert_eq!(lp["tokens"].as_array().unwrap().len(), steps);

        // Chat: the same numbers in chat's shape, up to 20 alternatives.
        let chat = json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2, "temperature": 0, "ignore_eos": true, "logprobs": true,
            "top_logprobs": 20});
        let (status, v) = dyn_tests::post_json(&g.url("/v1/chat/completions"), &chat).await;
        assert_eq!(status, 200, "{v}");
        let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
        assert_eq!(content.len(), 2, "{v}");
        for c in content {
            let top = c["top_logprobs"].as_array().unwrap();
            assert_eq!(top.len(), 20);
            // Greedy: the chosen token is the most likely one.
            assert_eq!(top[0]["logprob"], c["logprob"], "{c}");
            assert!(c["bytes"].is_array());
        }

        // Echo: the prompt's log-probabilities, the first one null.
        let mut prompt = case.prompt.clone();
        prompt.extend(&case.greedy[..steps - 1]);
        let mut body = greedy_body(&prompt, 1);
        body["logprobs"] = json!(1);
        body["echo"] = json!(true);
        let v = complete(&url, body).await;
        let lp = &v["choices"][0]["logprobs"];
        let got = lp["token_logprobs"].as_array().unwrap();
        assert_eq!(got.len(), prompt.len() + 1, "{lp}");
        assert!(got[0].is_null() && lp["top_logprobs"][0].is_null(), "{lp}");
        for i in 0..steps {
            close(&got[case.prompt.len() + i], want[i], &format!("echo {i}"));
        }
    }
    // lm-evaluation-harness's batched log-likelihoods: every case's prompt in one request,
    // as lists of token ids, echoed with log-probabilities: each choice as its prompt alone.
    let prompts: Vec<Vec<u32>> = reference().iter().map(|c| c.prompt.clone()).collect();
    let mut alone = Vec::new();
    for p in &prompts {
        let mut body = greedy_body(p, 1);
        body["logprobs"] = json!(1);
        body["echo"] = json!(true);
        alone.push(complete(&url, body).await["choices"][0]["logprobs"]["token_logprobs"].clone());
    }
    let mut body = greedy_body(&[], 1);
    body["prompt"] = json!(prompts);
    body["logprobs"] = json!(1);
    body["echo"] = json!(true);
    let v = complete(&url, body).await;
    for (i, want) in alone.iter().enumerate() {
        let got = &v["choices"][i]["logprobs"]["token_logprobs"];
        let (got, want) = (got.as_array().unwrap(), want.as_array().unwrap());
        assert_eq!(got.len(), want.len(), "prompt {i}: {v}");
        for (g, w) in got.iter().zip(want).skip(1) {
            let (g, w) = (g.as_f64().unwrap(), w.as_f64().unwrap());
            assert!((g - w).abs() < 1e-3, "prompt {i}: {g} against {w}");
        }
    }
    // vLLM's return_token_ids: the answer's ids (the greedy reference) and the prompt's,
    // unary and streamed, completions and chat.
    let case = &reference()[0];
    let mut body = greedy_body(&case.prompt, case.greedy.len());
    body["return_token_ids"] = json!(true);
    let v = complete(&url, body.clone()).await;
    assert_eq!(v["choices"][0]["token_ids"], json!(case.greedy), "{v}");
    assert_eq!(
        v["choices"][0]["prompt_token_ids"],
        json!(case.prompt),
        "{v}"
    );
    body["stream"] = json!(true);
    let (events, text) = dyn_tests::sse_events(&format!("{url}/v1/completions"), &body).await;
    let (mut ids, mut prompt) = (Vec::new(), Vec::new());
    for c in &events {
        let choice = &c["choices"][0];
        ids.extend(
            choice["token_ids"]
                .as_array()
                .into_iter()
                .flatten()
                .cloned(),
        );
        let p = choice["prompt_token_ids"].as_array();
        prompt.extend(p.into_iter().flatten().cloned());
    }
    assert_eq!(
        (json!(ids), json!(prompt)),
        (json!(case.greedy), json!(case.prompt)),
        "{text}"
    );
    let chat = json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3, "ignore_eos": true, "return_token_ids": true});
    let (_, v) = dyn_tests::post_json(&g.url("/v1/chat/completions"), &chat).await;
    assert_eq!(
        v["prompt_token_ids"].as_array().map(Vec::len),
        v["usage"]["prompt_tokens"].as_u64().map(|n| n as usize),
        "{v}"
    );
    assert_eq!(
        v["choices"][0]["token_ids"].as_array().map(Vec::len),
        Some(3),
        "{v}"
    );

    // Completions take more than OpenAI's 5 alternatives: up to the ingress's `max_logprobs`
    // (20 by default, as vLLM's). (Greedy, so the same tokens each run: alternatives are keyed
    // by their text, and pieces of one character share a key, so fewer than 12 may show.)
    let (status, v) = dyn_tests::post_json(
        &g.url("/v1/completions"),
        &json!({"model": "tiny", "prompt": "hi", "max_tokens": 2, "logprobs": 12,
                "temperature": 0}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let top = &v["choices"][0]["logprobs"]["top_logprobs"][0];
    assert!(
        top.as_object().is_some_and(|m| (6..=13).contains(&m.len())),
        "{v}"
    );
    // Bounds: past `max_logprobs`, and chat's top_logprobs only with logprobs.
    for (path, body, param) in [
        (
            "/v1/completions",
            json!({"model": "tiny", "prompt": "hi", "logprobs": 21}),
            "logprobs",
        ),
        (
            "/v1/chat/completions",
            json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}),
            "top_logprobs",
        ),
    ] {
        let (status, v) = dyn_tests::post_json(&g.url(path), &body).await;
        assert_eq!(
            (status, v["error"]["param"].as_str()),
            (400, Some(param)),
            "{v}"
        );
    }
}

/// `n` choices: the prompt is computed once (the others find its full blocks in the prefix
/// cache), each choice is seeded `seed + index` so the set repeats, and greedy choices agree.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_share_the_prompt_and_repeat_with_a_seed() {
    let g = Graph::up_with_ingress("graphs/agg_native.yaml", "http", &[]);
    let url = g.url("");
    let prompt: Vec<u32> = (0..40).map(|i| 3 + i * 7 % 600).collect();
    let prefilled = || metric(&g.get("/metrics"), &["dyn_worker_prefill_tokens_total"]);
    let before = prefilled();
    let body = json!({"model": "tiny", "prompt": prompt, "max_tokens": 6, "ignore_eos": true,
                      "temperature": 1.0, "seed": 5, "n": 3});
    let a = complete(&url, body.clone()).await;
    // 40 tokens: two full blocks of 16 computed once, the last 8 by each choice.
    assert_eq!(prefilled() - before, 40 + 2 * 8);
    let texts = |v: &Value| -> Vec<String> {
        let c = v["choices"].as_array().unwrap();
        assert_eq!(c.len(), 3, "{v}");
        c.iter()
            .enumerate()
            .map(|(i, c)| {
                assert_eq!(c["index"], i, "{v}");
                c["text"].as_str().unwrap().to_owned()
            })
            .collect()
    };
    let (ta, tb) = (texts(&a), texts(&complete(&url, body.clone()).await));
    assert_eq!(ta, tb, "the same seed gives the same choices");
    assert!(ta[0] != ta[1] || ta[1] != ta[2], "choices differ: {ta:?}");
    assert_eq!(a["usage"]["completion_tokens"], 18, "{a}");
    assert_eq!(a["usage"]["prompt_tokens"], 40, "{a}");
    // Choice i of n is the single answer seeded seed + i.
    let mut one = body.clone();
    one["n"] = json!(1);
    one["seed"] = json!(6);
    assert_eq!(texts_of(&complete(&url, one).await), ta[1]);
    // Greedy choices are all the greedy answer.
    let mut greedy = body;
    greedy["temperature"] = json!(0);
    let t = texts(&complete(&url, greedy.clone()).await);
    assert!(t.iter().all(|x| *x == t[0]), "{t:?}");
    // Streamed: every choice's chunks carry its index and each ends once.
    greedy["stream"] = json!(true);
    let (events, text) = dyn_tests::sse_events(&format!("{url}/v1/completions"), &greedy).await;
    let mut ended = [0; 3];
    let mut streamed = vec![String::new(); 3];
    for v in events.iter().filter(|v| v["choices"][0].is_object()) {
        let c = &v["choices"][0];
        let i = c["index"].as_u64().unwrap() as usize;
        streamed[i].push_str(c["text"].as_str().unwrap());
        if !c["finish_reason"].is_null() {
            ended[i] += 1;
        }
    }
    assert_eq!(ended, [1, 1, 1], "{text}");
    assert_eq!(streamed, t);
}

/// Reasoning split from the answer (`model.reasoning_parser: qwen3`): a grammar makes the
/// tiny model think in `<think>…</think>` and then answer; chat returns the two apart, unary
/// and streamed alike, and the tags never reach the client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reasoning_goes_to_reasoning_content_unary_and_streamed() {
    let g = Graph::up_with_ingress(
        "graphs/agg_native.yaml",
        "http",
        &["--set", "model.reasoning_parser=qwen3"],
    );
    let body = json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 40, "temperature": 0,
        "structured_outputs": {"regex": "<think>[a-z]{2,6} [a-z]{2,6}</think>[a-z]{2,6}"}});
    let (status, v) = dyn_tests::post_json(&g.url("/v1/chat/completions"), &body).await;
    assert_eq!(status, 200, "{v}");
    let m = &v["choices"][0]["message"];
    let (reasoning, content) = (
        m["reasoning_content"].as_str().unwrap(),
        m["content"].as_str().unwrap(),
    );
    assert!(reasoning.contains(' ') && !reasoning.contains('<'), "{v}");
    assert!(
        !content.is_empty() && content.bytes().all(|b| b.is_ascii_lowercase()),
        "{v}"
    );
    let mut streamed = body;
    streamed["stream"] = json!(true);
    let (events, text) = dyn_tests::sse_events(&g.url("/v1/chat/completions"), &streamed).await;
    let (mut r, mut c) = (String::new(), String::new());
    for v in &events {
        let d = &v["choices"][0]["delta"];
        r.push_str(d["reasoning_content"].as_str().unwrap_or(""));
        c.push_str(d["content"].as_str().unwrap_or(""));
    }
    assert_eq!((r.as_str(), c.as_str()), (reasoning, content), "{text}");
}

fn texts_of(v: &Value) -> String {
    v["choices"][0]["text"].as_str().unwrap().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampling_is_seeded_and_bad_input_is_refused() {
    let g = Graph::up_with_ingress("graphs/agg_native.yaml", "http", &[]);
    let url = g.url("");
    let case = &reference()[1];
    let sampled = |seed: u64| {
        json!({"model": "tiny", "prompt": case.prompt, "max_tokens": 12, "ignore_eos": true,
               "temperature": 1.0, "top_p": 0.9, "top_k": 50, "seed": seed})
    };
    let a = complete(&url, sampled(7)).await;
    let b = complete(&url, sampled(7)).await;
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);
    let runs = [8, 9, 10, 11].map(|seed| complete(&url, sampled(seed)));
    let texts: std::collections::BTreeSet<String> = futures::future::join_all(runs)
        .await
        .iter()
        .map(|v| v["choices"][0]["text"].to_string())
        .collect();
    assert!(
        texts.len() > 1,
        "different seeds, different samples: {texts:?}"
    );
    // top_k 1 is greedy.
    let k1 = complete(
        &url,
        json!({"model": "tiny", "prompt": case.prompt, "max_tokens": 12, "ignore_eos": true,
               "temperature": 1.0, "top_k": 1}),
    )
    .await;
    let greedy = complete(&url, greedy_body(&case.prompt, 12)).await;
    assert_eq!(k1["choices"][0]["text"], greedy["choices"][0]["text"]);

    // The sampling knobs, through HTTP to the engine. min_p 1 keeps only the best token:
    // greedy whatever the temperature.
    let with = |extra: Value| {
        let mut b = greedy_body(&case.prompt, 12);
        b.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        b
    };
    let text = |v: &Value| v["choices"][0]["text"].as_str().unwrap().to_owned();
    let v = complete(
        &url,
        with(json!({"temperature": 1.0, "min_p": 1.0, "seed": 3})),
    )
    .await;
    assert_eq!(text(&v), text(&greedy));
    // A +100 bias makes one token win every step; -100 on the greedy first token bans it.
    let tok = tokenizers::Tokenizer::from_file(root().join("models/tiny/tokenizer.json")).unwrap();
    let v = complete(&url, with(json!({"logit_bias": {"7": 100}}))).await;
    assert_eq!(text(&v), tok.decode(&[7; 12], true).unwrap());
    let first = case.greedy[0].to_string();
    let v = complete(&url, with(json!({"logit_bias": {first: -100}}))).await;
    assert_ne!(text(&v), text(&greedy));
    // A stop token ends the output where greedy decoding reaches it, ignore_eos or not.
    let v = complete(&url, with(json!({"stop_token_ids": [case.greedy[3]]}))).await;
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 4, "{v}");
    // ... and is not part of the text, as vLLM leaves it out.
    assert_eq!(text(&v), tok.decode(&case.greedy[..3], true).unwrap());
    // The repetition penalty reaches the prompt's tokens: a prompt token that a +100 bias
    // makes win every step no longer wins once divided by 1000 (its logit ≈ 0.1, under the
    // best of the rest). Its arithmetic, and the other penalties', is checked in dyn-compute.
    let t = case.prompt[0];
    let biased = json!({"logit_bias": {t.to_string(): 100}, "max_tokens": 1});
    let v = complete(&url, with(biased.clone())).await;
    assert_eq!(text(&v), tok.decode(&[t], true).unwrap());
    let mut penalized = biased;
    penalized["repetition_penalty"] = json!(1000.0);
    let v = complete(&url, with(penalized)).await;
    assert_ne!(text(&v), tok.decode(&[t], true).unwrap());

    for (body, param) in [
        (
            json!({"model": "tiny", "prompt": [1, 100000], "max_tokens": 4}),
            "prompt",
        ),
        (
            json!({"model": "tiny", "prompt": "hi", "max_tokens": 4, "top_k": -5}),
            "top_k",
        ),
        (
            json!({"model": "tiny", "prompt": "hi", "max_tokens": 4, "logit_bias": {"100000": 1}}),
            "logit_bias",
        ),
        (
            json!({"model": "tiny", "prompt": "hi", "max_tokens": 4, "logit_bias": {"5": 101}}),
            "logit_bias",
        ),
        (
            json!({"model": "tiny", "prompt": "hi", "max_tokens": 4, "stop_token_ids": [100000]}),
            "stop_token_ids",
        ),
        (
            json!({"model": "tiny", "prompt": "hi", "max_tokens": 4, "presence_penalty": 2.5}),
            "presence_penalty",
        ),
        (
            json!({"model": "tiny", "prompt": "hi", "max_tokens": 4, "repetition_penalty": 0}),
            "repetition_penalty",
        ),
        (
            json!({"model": "tiny", "prompt": "hi", "max_tokens": 4, "min_p": 1.5}),
            "min_p",
        ),
    ] {
        let (status, v) = completion(&url, &body).await;
        assert_eq!(status, 400);
        assert_eq!(v["error"]["param"], param, "{v}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preempted_sequences_recompute_to_the_same_greedy_output() {
    // 12 blocks of 4 tokens: each reference prompt plus 12 answer tokens needs up to 9, so
    // three at once cannot all fit and the newest are preempted and recomputed.
    let g = Graph::up_with_ingress(
        "graphs/agg_native.yaml",
        "http",
        &[
            "--set",
            "decode.native.num_blocks=12",
            "--set",
            "decode.native.block_size=4",
        ],
    );
    // Requests that arrive apart (a loaded machine) may each finish before the next needs
    // its blocks: batches go until one preempts, each checked.
    let mut m = String::new();
    for _ in 0..10 {
        all_at_once_match(&g.url(""), &reference(), 2).await;
        m = g.get("/metrics");
        if metric(&m, &["dyn_worker_preemptions_total"]) > 0 {
            return;
        }
    }
    panic!("the cache was small enough to preempt:\n{m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_larger_than_the_whole_cache_ends_with_length_instead_of_hanging() {
    // 6 blocks of 4 tokens: a 21-token prompt leaves room for 4 answer tokens.
    let g = Graph::up_with_ingress(
        "graphs/agg_native.yaml",
        "http",
        &[
            "--set",
            "decode.native.num_blocks=6",
            "--set",
            "decode.native.block_size=4",
        ],
    );
    let case = &reference()[2];
    assert_eq!(case.prompt.len(), 21);
    let v = complete(&g.url(""), greedy_body(&case.prompt, 12)).await;
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 4, "{v}");
    // A prompt that cannot fit at all is refused up front.
    let long: Vec<u32> = (0..30).map(|i| i % 600).collect();
    let (status, v) = completion(&g.url(""), &greedy_body(&long, 4)).await;
    assert_eq!(status, 400, "{v}");
}
