//! Many models behind one endpoint, through the real `dyn` binary and HTTP:
//!
//! - two base models in one graph (SmolLM2-135M-Instruct as GGUF and models/tiny, each on a
//!   native worker of its own): `/v1/models` lists both, and each request is tokenized,
//!   answered and detokenized by its own model's tokenizer (checked against the Hugging Face
//!   tokenizers of both), for completions and chat;
//! - two pools of one model (`graphs/pools.yaml`): long prompts go to the long pool, short ones
//!   to the short pool, counted by the router's `dyn_router_pool_requests_total`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is a failure report

use dyn_tests::{Graph, completion, long_prompt, metric, root, scratch_dir};
use serde_json::{Value, json};

fn env_path(var: &str) -> Option<String> {
    let p = std::env::var(var).ok()?;
    std::path::Path::new(&p).exists().then_some(p)
}

async fn metrics(g: &Graph) -> String {
    let r = reqwest::get(g.url("/metrics")).await.unwrap();
    r.text().await.unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    serde_json::from_value(v.clone()).unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn two_base_models_answer_each_with_its_own_tokenizer() {
    let (Some(gguf), Some(hf)) = (env_path("DYN_SMOLLM2_GGUF"), env_path("DYN_SMOLLM2_HF")) else {
        dyn_tests::skip("DYN_SMOLLM2_GGUF or DYN_SMOLLM2_HF is not set (scripts/test sets both)");
        return;
    };
    // graphs/models.yaml, with the model where this machine has it.
    let text = std::fs::read_to_string(root().join("graphs/models.yaml"))
        .unwrap()
        .replace("~/.cache/dyn/models/SmolLM2-135M-Instruct.Q4_1.gguf", &gguf)
        .replace(
            "../models/tiny",
            &root().join("models/tiny").display().to_string(),
        );
    let file = scratch_dir("models").join("models.yaml");
    std::fs::write(&file, text).unwrap();
    let g = Graph::up_with_ingress(file.to_str().unwrap(), "http", &[]);
    let url = g.url("");

    let listed = dyn_tests::get_json(&g.url("/v1/models")).await;
    let names: Vec<&str> = listed["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["smollm2", "tiny"], "{listed}");

    let tokenizers = [
        ("smollm2", format!("{hf}/tokenizer.json")),
        (
            "tiny",
            root()
                .join("models/tiny/tokenizer.json")
                .display()
                .to_string(),
        ),
    ];
    let prompt = "The quick brown fox jumps over the lazy dog";
    let mut prompts = Vec::new();
    for (model, file) in &tokenizers {
        let tok = tokenizers::Tokenizer::from_file(file).unwrap();
        let body = json!({"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0,
                          "ignore_eos": true, "return_token_ids": true});
        let (status, v) = completion(&url, &body).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["model"], *model, "{v}");
        let choice = &v["choices"][0];
        // The prompt as this model's tokenizer reads it (after any BOS the model adds)...
        let want = tok.encode(prompt, false).unwrap().get_ids().to_vec();
        let got = ids(&choice["prompt_token_ids"]);
        assert!(
            got.ends_with(&want),
            "{model}: prompt {got:?}, tokenizer says {want:?}"
        );
        // ... and the answer in its words.
        let out = ids(&choice["token_ids"]);
        assert_eq!(out.len(), 12, "{v}");
        assert_eq!(
            choice["text"].as_str().unwrap(),
            tok.decode(&out, true).unwrap(),
            "{model}"
        );
        prompts.push(got);
    }
    assert_ne!(
        prompts[0], prompts[1],
        "the two tokenizers read the prompt alike"
    );

    // Chat: each model's own template (SmolLM2's `<|im_start|>` turns; tiny's own).
    for (model, _) in &tokenizers {
        let body = json!({"model": model, "messages": [{"role": "user", "content": "Hi!"}],
                          "max_tokens": 4, "temperature": 0});
        let r = reqwest::Client::new()
            .post(g.url("/v1/chat/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["model"], *model, "{v}");
        assert!(
            v["usage"]["completion_tokens"].as_u64().unwrap() >= 1,
            "{v}"
        );
    }

    // `dyn inspect route` reads a prompt with the model it names, for that model's router.
    for (model, node) in [("smollm2", "route_smol"), ("tiny", "route_tiny")] {
        let v = dyn_tests::inspect_json(
            &url,
            &[
                "route", "--prompt", prompt, "--model", model, "--node", node,
            ],
        );
        assert_eq!(v["node"], node, "{v}");
        let tokens = v["replicas"][0]["prompt_tokens"].as_u64();
        let i = usize::from(model == "tiny");
        assert_eq!(tokens, Some(prompts[i].len() as u64), "{model}: {v}");
    }

    // Neither: a 404 naming both.
    let (status, v) = completion(&url, &json!({"model": "other", "prompt": "x"})).await;
    assert_eq!(status, 404, "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("serves `smollm2`, `tiny`"), "{msg}");

    // The official client sees both, answered under each one's name.
    if let Some(python) = std::env::var_os("DYN_TEST_PYTHON") {
        let lines = dyn_tests::python_lines(&python, "tests/py/models.py", &[&g.url("/v1")]);
        assert_eq!(lines[0], json!(["smollm2", "tiny"]));
        for (i, model) in ["smollm2", "tiny"].iter().enumerate() {
            let done = &lines[1 + 2 * i];
            assert_eq!(done["model"], *model, "{done}");
            assert!(done["prompt_tokens"].as_u64().unwrap() > 0, "{done}");
            assert_eq!(lines[2 + 2 * i], json!({"models": [model], "text": true}));
        }
        assert_eq!(lines[5], json!({"error": "NotFoundError", "status": 404}));
    } else {
        dyn_tests::skip("DYN_TEST_PYTHON is not set (scripts/test sets it up)");
    }

    // Each model's requests are counted under its name.
    let metrics = metrics(&g).await;
    for m in ["smollm2", "tiny"] {
        let label = format!("model=\"{m}\"");
        assert!(
            metric(
                &metrics,
                &["dyn_frontend_requests_total", &label, "status=\"success\""]
            ) >= 2,
            "{m}"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn long_prompts_go_to_the_long_pool() {
    let g = Graph::up_with_ingress("graphs/pools.yaml", "http", &[]);
    let url = g.url("");
    let ask = |prompt: String| {
        let url = url.clone();
        async move {
            let body = json!({"model": "tiny", "prompt": prompt, "max_tokens": 4});
            completion(&url, &body).await
        }
    };
    // Six of each at once, interleaved.
    let asks = (0..12).map(|i| {
        if i % 2 == 0 {
            ask(format!("a short prompt {i}"))
        } else {
            ask(long_prompt(i))
        }
    });
    for (i, (status, v)) in futures::future::join_all(asks)
        .await
        .into_iter()
        .enumerate()
    {
        assert_eq!(status, 200, "{v}");
        let n = v["usage"]["prompt_tokens"].as_u64().unwrap();
        assert_eq!(n > 512, i % 2 == 1, "request {i}: {n} prompt tokens");
    }
    let metrics = metrics(&g).await;
    let sent = |pool: &str| {
        metric(
            &metrics,
            &[
                "dyn_router_pool_requests_total",
                &format!("pool=\"{pool}\""),
            ],
        )
    };
    assert_eq!((sent("short"), sent("long")), (6, 6), "{metrics}");

    // A target that is no latency is refused, naming the field.
    let body = json!({"model": "tiny", "prompt": "x", "nvext": {"router": {"ttft_target": 0}}});
    let (status, v) = completion(&url, &body).await;
    assert_eq!(
        (status, &v["error"]["param"]),
        (400, &json!("nvext.router.ttft_target")),
        "{v}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_planner_scales_each_pool_on_its_own_targets() {
    // The long pool's TTFT target is out of reach, the short pool's generous: only the long
    // pool grows, although both see traffic.
    let g = Graph::up_with_ingress(
        "graphs/pools.yaml",
        "http",
        &[
            "--set",
            "planner.interval_s=1",
            "--set",
            "planner.nodes.long.ttft_ms=1",
            "--set",
            "planner.nodes.short.ttft_ms=60000",
        ],
    );
    let url = g.url("");
    let replicas = |metrics: &str, node: &str| {
        dyn_tests::metric_sum(
            metrics,
            "dyn_planner_replicas",
            &[&format!("node=\"{node}\""), "which=\"actual\""],
        )
    };
    let round = |round: usize| {
        let url = url.clone();
        let asks = (0..8).map(move |i| {
            let prompt = if i % 2 == 0 {
                format!("short {round} {i}")
            } else {
                long_prompt(round * 8 + i)
            };
            let body = json!({"model": "tiny", "prompt": prompt, "max_tokens": 8});
            let url = url.clone();
            async move { completion(&url, &body).await }
        });
        futures::future::join_all(asks)
    };
    let mut grown = false;
    for r in 0..12 {
        for (status, v) in round(r).await {
            assert_eq!(status, 200, "{v}");
        }
        let metrics = metrics(&g).await;
        // (0 until the planner's first decision.)
        let short = replicas(&metrics, "short");
        assert!(
            short == 0.0 || short == 2.0,
            "short left its minimum: {short}"
        );
        if short == 2.0 && replicas(&metrics, "long") >= 2.0 {
            grown = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
    assert!(grown, "the long pool did not grow");

    // The planner sees each pool's own traffic (the frontend counts it by pool): the long
    // prompts in the long pool, the short ones in the short pool.
    let mut seen = Value::Null;
    for r in 12..24 {
        round(r).await;
        seen = dyn_tests::inspect_json(&g.url(""), &["planner"]);
        let pools = &seen["observed"]["pools"];
        let isl = |p: &str| pools[p]["isl"].as_f64();
        if let (Some(long), Some(short)) = (isl("long"), isl("short")) {
            assert!(long > 512.0 && short < 64.0, "{seen}");
            return;
        }
    }
    panic!("the planner never saw both pools: {seen}");
}
