//! The native engine behind the real `dyn` binary and HTTP (`graphs/agg_native.yaml`):
//! greedy completions of the tiny random-weight Llama equal Hugging Face transformers'
//! reference tokens whether requests run alone or batched, a repeated prompt is served from
//! the prefix cache with the same answer, preempted sequences recompute to the same answer, a
//! request larger than the whole cache ends with `length` instead of hanging, seeded sampling
//! repeats, logit bias, min-p, penalties and stop tokens act, and bad input is a 400.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is a failure report

use dyn_tests::{Graph, completion, metric, root};
use serde_json::{Value, json};

struct Case {
    prompt: Vec<u32>,
    greedy: Vec<u32>,
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
    all_at_once_match(&g.url(""), &reference(), 2).await;
    let m = g.get("/metrics");
    assert!(
        metric(&m, &["dyn_worker_preemptions_total"]) > 0,
        "the cache was small enough to preempt:\n{m}"
    );
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
