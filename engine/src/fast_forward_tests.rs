//! Fast-forward through the engines: a forced tool call's text comes in the tokenizer's own
//! tokens, the forced runs appended without being sampled, within `max_tokens` and stop
//! tokens, and not for a request that asks for log-probabilities.

use dyn_core::planes::Planes;
use dyn_llm::model::ModelDir;
use dyn_protocol::types::{Constraint, FinishReason, Generated};
use futures::StreamExt;
use serde_json::{Value, json};

use crate::{EngineHandle, handle::request_items, mocker, native};

fn tiny() -> ModelDir {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../models/tiny");
    ModelDir::load("tiny", std::path::Path::new(dir)).expect("tokenizer")
}

/// A forced Hermes call of `get_weather` whose city is one of two: only the city's first
/// token is the model's choice, everything else is forced.
fn weather_call() -> Constraint {
    dyn_protocol::testing::weather_call(json!({"enum": ["Paris", "Tokyo"]}))
}

/// What a request came to: its tokens (eos left out), the items they came in (about one a
/// step), its finish, and how many log-probabilities came with them.
struct Answer {
    ids: Vec<u32>,
    items: usize,
    finish: Option<FinishReason>,
    logprobs: usize,
}

async fn ask(
    engine: &EngineHandle,
    m: &ModelDir,
    max_tokens: u32,
    edit: impl FnOnce(&mut dyn_protocol::types::PreprocessedRequest),
) -> Answer {
    let mut req = dyn_protocol::testing::preprocessed((1..30).collect(), max_tokens);
    req.stop.eos_token_ids = m.eos_token_ids.clone();
    req.sampling.temperature = Some(0.0);
    req.sampling.constraint = Some(weather_call());
    edit(&mut req);
    let rx = engine.submit(&req, None, None).await.expect("submitted");
    let mut a = Answer {
        ids: Vec::new(),
        items: 0,
        finish: None,
        logprobs: 0,
    };
    for item in request_items(rx).collect::<Vec<_>>().await {
        if let Generated::Tokens {
            ids,
            finish,
            logprobs,
            ..
        } = item.expect("no error")
        {
            a.items += 1;
            a.ids.extend(ids);
            a.finish = a.finish.or(finish);
            a.logprobs += logprobs.map_or(0, |l| l.tokens.len());
        }
    }
    a.ids.retain(|t| !m.eos_token_ids.contains(t));
    a
}

/// The call in `ids`, parsed: its city.
fn city(m: &ModelDir, ids: &[u32]) -> String {
    called_city(&m.tokenizer.decode(ids, false).expect("decodes"))
}

/// The city of the forced `get_weather` call that `text` is (a panic if it is not one).
pub(crate) fn called_city(text: &str) -> String {
    let body = text
        .strip_prefix("<tool_call>\n")
        .and_then(|t| t.strip_suffix("\n</tool_call>"))
        .unwrap_or_else(|| panic!("not a call: {text:?}"));
    let v: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{body:?}: {e}"));
    assert_eq!(v["name"], "get_weather", "{text}");
    v["arguments"]["city"].as_str().expect("a city").to_string()
}

/// The tokenizer's own encoding of the text of `ids`.
fn normal(m: &ModelDir, ids: &[u32]) -> Vec<u32> {
    let text = m.tokenizer.decode(ids, false).expect("decodes");
    m.tokenizer
        .encode(text.as_str(), false)
        .expect("encodes")
        .get_ids()
        .to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forced_call_on_the_mocker_costs_its_own_length_in_few_steps() {
    let planes = Planes::embedded();
    let m = tiny();
    let start = |fast_forward| {
        let config = mocker::MockerConfig {
            speedup: 1000.0,
            fast_forward,
            ..mocker::MockerConfig::default()
        };
        let cx = dyn_protocol::testing::cx("decode", 1, &[], &planes);
        async move { mocker::start(&config, &cx).await.expect("starts") }
    };
    let (on, off) = (start(true).await, start(false).await);
    let fast = ask(&on, &m, 64, |_| {}).await;
    let slow = ask(&off, &m, 64, |_| {}).await;
    for a in [&fast, &slow] {
        assert!(["Paris", "Tokyo"].contains(&city(&m, &a.ids).as_str()));
        assert_eq!(a.finish, Some(FinishReason::Stop));
        // The forced text in the tokenizer's own tokens: the call costs about the length of
        // its normal encoding (the city's first token is the model's pick, so its split may
        // differ by a token or two).
        let n = normal(&m, &a.ids).len();
        assert!(a.ids.len() <= n + 2, "{} tokens for {n}", a.ids.len());
    }
    // Without fast-forward a token a step; with it, the forced runs come in a step each:
    // the prefill's, the city's, the eos.
    assert!(slow.items >= slow.ids.len(), "{}", slow.items);
    assert!(fast.items <= 5, "{} items", fast.items);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forced_call_on_the_native_engine_keeps_max_tokens_stop_tokens_and_logprobs() {
    let planes = Planes::embedded();
    let m = tiny();
    let cx = dyn_protocol::testing::cx("decode", 7, &[], &planes);
    let engine = native::start(&native::NativeConfig::default(), &cx)
        .await
        .expect("starts");
    let whole = ask(&engine, &m, 64, |_| {}).await;
    city(&m, &whole.ids);
    assert_eq!(whole.finish, Some(FinishReason::Stop));
    assert!(whole.ids.len() <= normal(&m, &whole.ids).len() + 2);
    assert!(whole.items <= 5, "{} items", whole.items);
    // The budget cuts a forced run: exactly `max_tokens`, a prefix of the whole call.
    let cut = ask(&engine, &m, 5, |_| {}).await;
    assert_eq!(cut.ids, whole.ids[..5], "temperature 0: the same call");
    assert_eq!(cut.finish, Some(FinishReason::Length));
    // A stop token inside a forced run ends the output there.
    let stop = whole.ids[3];
    let first = whole.ids.iter().position(|&t| t == stop).expect("in it");
    let stopped = ask(&engine, &m, 64, |r| r.stop.stop_token_ids = vec![stop]).await;
    assert_eq!(stopped.ids, whole.ids[..=first]);
    assert_eq!(stopped.finish, Some(FinishReason::Stop));
    // With log-probabilities every token is sampled, and has its own: the same tokens, one
    // log-probability each.
    let lp = ask(&engine, &m, 64, |r| r.sampling.logprobs = Some(0)).await;
    assert_eq!(lp.ids, whole.ids);
    assert_eq!(lp.logprobs, lp.ids.len() + 1, "the eos has one too");
}
