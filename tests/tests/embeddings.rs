//! `POST /v1/embeddings` through the real binary: SmolLM2's embeddings (its f32 Hugging Face
//! directory on the native CPU engine) equal transformers' pooled final hidden states of the
//! same model — last token by default, mean where the directory's sentence-transformers
//! config says — within 1e-4; token-id inputs equal text inputs; the official `openai`
//! client's `embeddings.create` (base64, its default, and floats) gets the same vectors; and
//! an engine that has no hidden states (the mocker) refuses with a 400.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is a failure report

use dyn_tests::{Graph, post_json, python_lines};
use serde_json::{Value, json};

fn env_path(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// `hf` as a sentence-transformers directory that mean-pools: its files linked, and the
/// pooling module's config beside them.
fn mean_pooling_dir(hf: &str) -> String {
    let dir = dyn_tests::scratch_dir("smollm2-mean");
    for entry in std::fs::read_dir(hf).unwrap() {
        let entry = entry.unwrap();
        let to = dir.join(entry.file_name());
        let _ = std::fs::remove_file(&to);
        std::os::unix::fs::symlink(entry.path(), to).unwrap();
    }
    std::fs::write(
        dir.join("modules.json"),
        json!([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
        ])
        .to_string(),
    )
    .unwrap();
    std::fs::create_dir_all(dir.join("1_Pooling")).unwrap();
    std::fs::write(
        dir.join("1_Pooling/config.json"),
        json!({"word_embedding_dimension": 576, "pooling_mode_mean_tokens": true,
               "pooling_mode_lasttoken": false, "pooling_mode_cls_token": false})
        .to_string(),
    )
    .unwrap();
    dir.display().to_string()
}

fn vectors(v: &Value) -> Vec<Vec<f64>> {
    v["data"]
        .as_array()
        .unwrap_or_else(|| panic!("{v}"))
        .iter()
        .map(|d| serde_json::from_value(d["embedding"].clone()).unwrap())
        .collect()
}

fn max_diff(a: &[Vec<f64>], b: &[Vec<f64>]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| {
            assert_eq!(x.len(), y.len());
            x.iter().zip(y).map(|(p, q)| (p - q).abs())
        })
        .fold(0.0, f64::max)
}

#[tokio::test(flavor = "multi_thread")]
async fn embeddings_equal_transformers_pooled_hidden_states() {
    let (Some(hf), Some(torch)) = (env_path("DYN_SMOLLM2_HF"), env_path("DYN_VLLM_PYTHON")) else {
        dyn_tests::skip(
            "DYN_SMOLLM2_HF or DYN_VLLM_PYTHON (transformers) is not set (scripts/engines vllm sets both up)",
        );
        return;
    };
    let texts = [
        "The capital of France is Paris.",
        "Embeddings map a text to a vector.",
        "hello",
        "A longer input, so that its prompt runs to more than one KV block of sixteen tokens, and then some more words.",
    ];
    for pooling in ["last", "mean"] {
        let dir = if pooling == "last" {
            hf.clone()
        } else {
            mean_pooling_dir(&hf)
        };
        let g = Graph::up_with_ingress(
            "graphs/chat.yaml",
            "http",
            &["--set", &format!("model.path={dir}")],
        );
        let (status, v) = post_json(
            &g.url("/v1/embeddings"),
            &json!({"model": "smollm2", "input": texts, "encoding_format": "float"}),
        )
        .await;
        assert_eq!(status, 200, "{v}");
        let got = vectors(&v);
        assert_eq!(got[0].len(), 576, "SmolLM2-135M's width");
        // The prompts' token ids, as /tokenize reads them.
        let mut ids: Vec<Vec<u32>> = Vec::new();
        for t in texts {
            let (_, tok) = post_json(&g.url("/tokenize"), &json!({"prompt": t})).await;
            ids.push(serde_json::from_value(tok["tokens"].clone()).unwrap());
        }
        let tokens: usize = ids.iter().map(Vec::len).sum();
        assert_eq!(v["usage"]["prompt_tokens"], tokens, "{v}");
        // Token ids in are the same prompts.
        let (status, by_ids) = post_json(
            &g.url("/v1/embeddings"),
            &json!({"model": "smollm2", "input": ids, "encoding_format": "float"}),
        )
        .await;
        assert_eq!(status, 200, "{by_ids}");
        assert!(max_diff(&got, &vectors(&by_ids)) < 1e-6);
        // transformers, float32, on the same directory.
        let ids_json = serde_json::to_string(&ids).unwrap();
        let reference = python_lines(
            std::ffi::OsStr::new(&torch),
            "tests/py/embeddings_ref.py",
            &[&dir, pooling, &ids_json],
        );
        let want: Vec<Vec<f64>> = serde_json::from_value(reference[0].clone()).unwrap();
        let diff = max_diff(&got, &want);
        println!("{pooling} pooling: largest difference from transformers {diff:.2e}");
        assert!(diff < 1e-4, "{pooling}: {diff}");

        // The official client: base64 (its default) and floats, the same vectors.
        if pooling == "last" {
            match std::env::var_os("DYN_TEST_PYTHON") {
                Some(python) => {
                    let texts_json = serde_json::to_string(&texts).unwrap();
                    let lines = python_lines(
                        &python,
                        "tests/py/embeddings.py",
                        &[&g.url("/v1"), "smollm2", &texts_json],
                    );
                    let last = lines.last().unwrap();
                    let client: Vec<Vec<f64>> =
                        serde_json::from_value(last["vectors"].clone()).unwrap();
                    assert!(max_diff(&got, &client) < 1e-6, "{lines:?}");
                }
                None => dyn_tests::skip("DYN_TEST_PYTHON is not set (scripts/test sets it up)"),
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_engine_without_hidden_states_refuses_embeddings() {
    let g = Graph::up_with_ingress("graphs/agg.yaml", "http", &[]);
    let (status, v) = post_json(
        &g.url("/v1/embeddings"),
        &json!({"model": "tiny", "input": "hello"}),
    )
    .await;
    assert_eq!(status, 400, "{v}");
    // Refused where the request is checked (the graph's workers are simulated, as their
    // config says), not after it reached one.
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("not available from this model's workers"),
        "{v}"
    );
    assert_eq!(v["error"]["param"], "model", "{v}");
    let (status, v) = post_json(
        &g.url("/v1/completions"),
        &json!({"model": "tiny", "prompt": "hello", "logprobs": 2, "max_tokens": 2}),
    )
    .await;
    assert_eq!(
        (status, &v["error"]["param"]),
        (400, &json!("logprobs")),
        "{v}"
    );
    for (body, param) in [
        (json!({"model": "tiny", "input": []}), "input"),
        (json!({"model": "tiny", "input": ["a", ""]}), "input[1]"),
        (
            json!({"model": "tiny", "input": "a", "encoding_format": "hex"}),
            "encoding_format",
        ),
        (
            json!({"model": "tiny", "input": "a", "truncate_prompt_tokens": 4}),
            "truncate_prompt_tokens",
        ),
    ] {
        let (status, v) = post_json(&g.url("/v1/embeddings"), &body).await;
        assert_eq!(
            (status, v["error"]["param"].as_str()),
            (400, Some(param)),
            "{v}"
        );
    }
    let (status, v) = post_json(
        &g.url("/v1/embeddings"),
        &json!({"model": "nope", "input": "a"}),
    )
    .await;
    assert_eq!(status, 404, "{v}");
}
