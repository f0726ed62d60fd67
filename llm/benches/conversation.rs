//! A conversation's last turn through `preprocess`: a 40-turn conversation of ~33k tokens on
//! the tiny model's tokenizer (with a 64k context), rendered and tokenized whole, and with the
//! prefix cache holding the previous turn (`full` vs `cached`), and the two parts of a full
//! turn (`render`, `encode`).
//!
//! ```text
//! cargo bench -p dyn-llm --bench conversation
//! ```

#![allow(clippy::unwrap_used, clippy::expect_used)] // a benchmark: fail loudly

use std::sync::Arc;

use criterion::{Criterion, criterion_group, criterion_main};
use dyn_llm::model::ModelDir;
use dyn_llm::preprocess::Preprocess;
use dyn_protocol::types::{ChatMessage, Endpoint, Limits, LlmRequest, Prompt, Sampling};

fn conversation(turns: usize, words: usize) -> Vec<ChatMessage> {
    // Deterministic filler: words of 2 to 9 letters.
    let mut seed = 7u64;
    let mut word = || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let len = 2 + (seed >> 60) as usize % 8;
        (0..len)
            .map(|i| (b'a' + ((seed >> (i * 5)) % 26) as u8) as char)
            .collect::<String>()
    };
    let mut text = |n: usize| (0..n).map(|_| word()).collect::<Vec<_>>().join(" ") + ".";
    let mut m = vec![ChatMessage::text("system", &text(40))];
    for _ in 0..turns {
        m.push(ChatMessage::text("user", &text(words)));
        m.push(ChatMessage::text("assistant", &text(words)));
    }
    m
}

fn request(messages: Vec<ChatMessage>) -> LlmRequest {
    LlmRequest {
        endpoint: Endpoint::Chat,
        model: "tiny".into(),
        prompt: Prompt::Messages(messages),
        sampling: Sampling::default(),
        routing: Default::default(),
        limits: Limits::default(),
        tools: vec![],
    }
}

fn bench(c: &mut Criterion) {
    let dir = tempfile_dir();
    let model = Arc::new(ModelDir::load("tiny", &dir).expect("model"));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let mut history = conversation(39, 78);
    history.push(ChatMessage::text("user", "And now?"));
    let previous = history[..history.len() - 2].to_vec();
    let full = Preprocess::new(model.clone()).expect("builds");
    let cached = Preprocess::new(model)
        .expect("builds")
        .with_prefix_cache(8 << 20);
    let tokens = rt
        .block_on(full.preprocess(request(history.clone())))
        .expect("preprocess")
        .token_ids
        .len();
    eprintln!("last turn: {} messages, {tokens} tokens", history.len());
    let mut g = c.benchmark_group("conversation_turn_40");
    g.bench_function("full", |b| {
        b.iter(|| {
            rt.block_on(full.preprocess(request(history.clone())))
                .expect("ok")
        })
    });
    // The previous turn is what the cache holds when this one arrives (a hit leaves it there).
    rt.block_on(cached.preprocess(request(previous.clone())))
        .expect("ok");
    g.bench_function("cached", |b| {
        b.iter(|| {
            rt.block_on(cached.preprocess(request(history.clone())))
                .expect("ok")
        })
    });
    g.bench_function("render", |b| {
        b.iter(|| full.render_with(&history, &[], true).expect("renders"))
    });
    let text = full.render_with(&history, &[], true).expect("renders");
    g.bench_function("encode", |b| {
        b.iter(|| {
            rt.block_on(full.tokenize(Prompt::Text(text.clone()), &[], Some(false), true))
                .expect("encodes")
        })
    });
    g.finish();
}

/// models/tiny with a 64k context (the conversation does not fit its 4k).
fn tempfile_dir() -> std::path::PathBuf {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tiny");
    let dir = std::env::temp_dir().join(format!("dyn-conversation-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        std::fs::copy(src.join(f), dir.join(f)).expect("copy");
    }
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).expect("config"))
            .expect("json");
    config["max_position_embeddings"] = 65536.into();
    std::fs::write(dir.join("config.json"), config.to_string()).expect("write");
    dir
}

criterion_group!(benches, bench);
criterion_main!(benches);
