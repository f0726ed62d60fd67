//! Grammars as an attacker writes them, through every entry point of the real binary: a
//! JSON Schema chaining 300 `$ref`s (19 KB) or a Lark grammar chaining 1,200 rules once
//! overflowed a 2 MiB stack and aborted the whole process. Each must now be a 400 naming the
//! limit, with the server still answering and its memory bounded; then random grammars and
//! schemas (depth, breadth, size) from a property-test generator, each answered 200 or 400.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is a failure report

use std::time::Duration;

use dyn_tests::Graph;
use proptest::prelude::*;
use serde_json::{Map, Value, json};

/// The aggregated graph (the tiny model's tokenizer, fast simulated workers).
fn up() -> Graph {
    Graph::up_with_ingress(
        "graphs/agg.yaml",
        "http",
        &["--set", "decode.mocker.speedup=100"],
    )
}

/// `n` schemas, each a `$ref` to the next.
fn ref_chain(n: usize) -> Value {
    let mut defs = Map::new();
    for i in 0..n {
        let next = if i + 1 == n {
            json!({"type": "string"})
        } else {
            json!({"$ref": format!("#/$defs/d{}", i + 1)})
        };
        defs.insert(format!("d{i}"), next);
    }
    json!({"$defs": defs, "$ref": "#/$defs/d0"})
}

/// A Lark grammar of `n` rules, each used once by the one before.
fn rule_chain(n: usize) -> String {
    let mut g = String::from("start: r0\n");
    for i in 0..n {
        if i + 1 == n {
            g.push_str(&format!("r{i}: \"x\"\n"));
        } else {
            g.push_str(&format!("r{i}: r{}\n", i + 1));
        }
    }
    g
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        // Only ends a hang (a regression that stalls); not a timing assertion.
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap()
}

async fn post(g: &Graph, path: &str, body: &Value) -> (u16, Value) {
    let r = client().post(g.url(path)).json(body).send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

fn chat(extra: Value) -> Value {
    let mut body =
        json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

/// The process still runs, and its resident memory (MiB).
fn alive_rss_mib(g: &Graph) -> u64 {
    dyn_tests::rss_bytes(g.pid()) >> 20
}

async fn answers_normally(g: &Graph) {
    let (status, body) = post(g, "/v1/chat/completions", &chat(json!({}))).await;
    assert_eq!(status, 200, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deep_grammars_are_refused_at_every_entry_point_and_the_server_stays_up() {
    let g = up();
    let deep = ref_chain(300);
    let tool = |schema: &Value| json!({"type": "function", "function": {"name": "f", "parameters": schema}});
    let bombs: Vec<(&str, &str, Value, &str)> = vec![
        (
            "response_format",
            "/v1/chat/completions",
            chat(
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": deep}}}),
            ),
            "64 levels",
        ),
        (
            "guided_json",
            "/v1/chat/completions",
            chat(json!({"guided_json": deep})),
            "64 levels",
        ),
        (
            "guided_grammar (Lark)",
            "/v1/chat/completions",
            chat(json!({"guided_grammar": rule_chain(1200)})),
            "128 levels",
        ),
        (
            "structured_outputs.grammar on completions",
            "/v1/completions",
            json!({"model": "tiny", "prompt": "hi", "max_tokens": 8, "structured_outputs": {"grammar": rule_chain(1200)}}),
            "128 levels",
        ),
        (
            "a forced tool's parameters",
            "/v1/chat/completions",
            chat(
                json!({"tools": [tool(&deep)], "tool_choice": {"type": "function", "function": {"name": "f"}}}),
            ),
            "64 levels",
        ),
        (
            "tool_choice required",
            "/v1/chat/completions",
            chat(json!({"tools": [tool(&deep)], "tool_choice": "required"})),
            "64 levels",
        ),
        (
            "Responses text.format",
            "/v1/responses",
            json!({"model": "tiny", "input": "hi", "max_output_tokens": 8,
                "text": {"format": {"type": "json_schema", "name": "x", "schema": deep}}}),
            "64 levels",
        ),
        (
            "an Anthropic tool's input_schema, forced",
            "/v1/messages",
            json!({"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"name": "f", "input_schema": deep}], "tool_choice": {"type": "tool", "name": "f"}}),
            "64 levels",
        ),
        (
            "a Lark chain of hyphenated names",
            "/v1/chat/completions",
            chat(
                json!({"guided_grammar": rule_chain(1200).replace(": r", ": r-").replace("\nr", "\nr-")}),
            ),
            "128 levels",
        ),
        (
            "a chain behind an $id that moves the references' base",
            "/v1/chat/completions",
            chat(json!({"guided_json": {"$defs": {"d0": {"type": "string"}},
                "properties": {"p": {"$id": "http://x/s", "$defs": deep["$defs"], "$ref": "#/$defs/d0"}},
                "$ref": "#/$defs/d0"}})),
            "$id",
        ),
        (
            "a choice of 50,000 strings",
            "/v1/chat/completions",
            chat(
                json!({"guided_choice": (0..50_000).map(|i| format!("option number {i:08}")).collect::<Vec<_>>()}),
            ),
            "4096",
        ),
    ];
    for (what, path, body, limit) in &bombs {
        let (status, answer) = post(&g, path, body).await;
        assert_eq!(status, 400, "{what}: {answer}");
        assert!(answer.to_string().contains(limit), "{what}: {answer}");
        // Answered, and the process is still the one that started.
        answers_normally(&g).await;
        let rss = alive_rss_mib(&g);
        assert!(rss < 1024, "{what}: RSS {rss} MiB");
    }
    // A deep grammar within the bounds compiles (the compile threads' stacks hold it).
    let (status, body) = post(
        &g,
        "/v1/chat/completions",
        &chat(json!({"guided_grammar": rule_chain(100)})),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"][0]["message"]["content"], "x", "{body}");
    let (status, body) = post(
        &g,
        "/v1/chat/completions",
        &chat(json!({"guided_json": ref_chain(60)})),
    )
    .await;
    assert_eq!(status, 200, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_grammars_compile_off_the_workers_steps_and_others_are_answered() {
    let g = up();
    // Four requests with the largest choice allowed, and one plain request beside them: all
    // answered; the plain one is not queued behind the compiles (they run on compile threads
    // before their requests are queued; its latency is measured in BENCHMARKS.md, not here).
    let options: Vec<String> = (0..4096)
        .map(|i| format!("choice {i:06} of many"))
        .collect();
    let big = chat(json!({"guided_choice": options, "max_tokens": 16}));
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..4 {
        let mut body = big.clone();
        // Different contents: no compile is shared through the cache.
        body["guided_choice"][0] = json!(format!("first of request {i}"));
        let url = g.url("/v1/chat/completions");
        tasks.spawn(async move {
            let r = client().post(url).json(&body).send().await.unwrap();
            let status = r.status().as_u16();
            let v: Value = r.json().await.unwrap();
            (status, v)
        });
    }
    answers_normally(&g).await;
    while let Some(r) = tasks.join_next().await {
        let (status, v) = r.unwrap();
        assert_eq!(status, 200, "{v}");
        let text = v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or_default();
        assert!(
            text.starts_with("choice ") || text.starts_with("first of"),
            "{v}"
        );
    }
    // Compiled once each: the metric counts compiles (cache misses), not requests.
    let metrics = reqwest::get(g.url("/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        dyn_tests::metric_sum(&metrics, "dyn_grammar_compile_seconds_count", &[]) >= 4.0,
        "{metrics}"
    );
}

/// A random schema: nesting kinds chosen per level, `depth` levels, `breadth` properties a
/// level, references through `$defs` where `refs`.
fn schema(depth: usize, breadth: usize, refs: bool, kinds: &[u8]) -> Value {
    let mut s = json!({"type": "string", "maxLength": 4});
    let mut defs = Map::new();
    for level in 0..depth {
        s = match kinds[level % kinds.len()] % 4 {
            0 => {
                // One property nests; the others are leaves (no 5^depth blow-up).
                let mut props = Map::new();
                props.insert("p0".into(), s);
                for i in 1..breadth {
                    props.insert(format!("p{i}"), json!({"type": "integer"}));
                }
                json!({"type": "object", "properties": props, "required": ["p0"], "additionalProperties": false})
            }
            1 => json!({"type": "array", "items": s, "maxItems": 2}),
            2 => json!({"anyOf": [s, {"type": "null"}]}),
            _ if refs => {
                defs.insert(format!("d{level}"), s);
                json!({"$ref": format!("#/$defs/d{level}")})
            }
            _ => json!({"allOf": [s]}),
        };
    }
    if let Value::Object(o) = &mut s
        && !defs.is_empty()
    {
        o.insert("$defs".into(), Value::Object(defs));
    }
    s
}

/// A random Lark grammar: `rules` rules in a chain, each with `parens` parentheses around its
/// use of the next, `alts` alternatives.
fn grammar(rules: usize, parens: usize, alts: usize) -> String {
    let mut g = String::from("start: r0\n");
    for i in 0..rules {
        let next = if i + 1 == rules {
            "\"x\"".to_owned()
        } else {
            format!("r{}", i + 1)
        };
        let body = format!("{}{next}{}", "(".repeat(parens), ")".repeat(parens));
        let others: Vec<String> = (1..alts.max(1)).map(|a| format!("\"a{a}\"")).collect();
        let mut all = vec![body];
        all.extend(others);
        g.push_str(&format!("r{i}: {}\n", all.join(" | ")));
    }
    g
}

#[test]
fn random_grammars_and_schemas_are_answered_200_or_400() {
    let g = up();
    let rt = tokio::runtime::Runtime::new().unwrap();
    // A bounded run (CI): 48 cases, shapes from shallow to far past every bound.
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 48,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    let shapes = prop_oneof![
        (
            1usize..400,
            1usize..6,
            any::<bool>(),
            proptest::collection::vec(any::<u8>(), 1..8)
        )
            .prop_map(|(d, b, r, k)| (Some(schema(d, b, r, &k)), None)),
        (1usize..1500, 0usize..300, 1usize..4).prop_map(|(r, p, a)| (None, Some(grammar(r, p, a)))),
    ];
    let result = runner.run(&shapes, |(schema, lark)| {
        let body = match (schema, lark) {
            (Some(s), _) => chat(json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}})),
            (_, Some(l)) => chat(json!({"guided_grammar": l})),
            _ => unreachable!(),
        };
        let (status, answer) = rt.block_on(post(&g, "/v1/chat/completions", &body));
        prop_assert!(status == 200 || status == 400, "{status}: {answer}");
        if status == 400 {
            // The grammar's bounds, or (deeper than any bound) the JSON parser's own.
            let e = &answer["error"];
            prop_assert!(
                e["param"] == "response_format"
                    || e["code"] == "invalid_json"
                    || e["code"] == "invalid_value",
                "{}",
                answer
            );
        }
        Ok(())
    });
    result.unwrap();
    rt.block_on(answers_normally(&g));
    let rss = alive_rss_mib(&g);
    assert!(rss < 1024, "RSS {rss} MiB");
}
