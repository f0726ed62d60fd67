//! Writes `models/tiny/`: trains a byte-level BPE tokenizer on `models/tiny/corpus.txt` and
//! writes the Hugging Face files next to it (`tokenizer.json`, `config.json`,
//! `tokenizer_config.json`, `generation_config.json`). Run through `scripts/make-tiny-model`;
//! training is deterministic, so re-running it reproduces the committed files.
#![allow(clippy::expect_used, clippy::unwrap_used)] // a generator script: fail loudly

use std::path::PathBuf;

use serde_json::json;
use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{
    AddedToken, DecoderWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper,
    Tokenizer, TokenizerBuilder, TokenizerImpl,
};

const SPECIALS: [&str; 5] = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
];

/// Llama 3's template, trimmed: a bos token, a header per message, `<|eot_id|>` after each.
const CHAT_TEMPLATE: &str = "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}";

fn main() {
    let dir = PathBuf::from(
        std::env::args()
            .nth(1)
            .unwrap_or_else(|| "models/tiny".into()),
    );
    let corpus = dir.join("corpus.txt");

    let mut trainer = BpeTrainerBuilder::new()
        .show_progress(false)
        .vocab_size(2048)
        .min_frequency(2)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .special_tokens(
            SPECIALS
                .iter()
                .map(|s| AddedToken::from(*s, true))
                .collect(),
        )
        .build();
    let mut tok: TokenizerImpl<
        BPE,
        NormalizerWrapper,
        PreTokenizerWrapper,
        PostProcessorWrapper,
        DecoderWrapper,
    > = TokenizerBuilder::new()
        .with_model(BPE::default())
        .with_normalizer(None)
        .with_pre_tokenizer(Some(ByteLevel::new(false, true, true).into()))
        .with_post_processor(None)
        .with_decoder(Some(ByteLevel::default().into()))
        .build()
        .expect("tokenizer builder");
    tok.train_from_files(&mut trainer, vec![corpus.display().to_string()])
        .expect("train");

    let bos = SPECIALS[0];
    let bos_id = tok.token_to_id(bos).expect("bos id");
    let template = TemplateProcessing::builder()
        .try_single(format!("{bos} $A"))
        .expect("single template")
        .try_pair(format!("{bos} $A {bos} $B"))
        .expect("pair template")
        .special_tokens(vec![(bos.to_owned(), bos_id)])
        .build()
        .expect("template");
    tok.with_post_processor(Some(template));
    let tok: Tokenizer = tok.into();
    tok.save(dir.join("tokenizer.json"), true).expect("save");

    let id = |t: &str| tok.token_to_id(t).expect("special id");
    let vocab = tok.get_vocab_size(true);
    let write = |name: &str, v: serde_json::Value| {
        let text = serde_json::to_string_pretty(&v).expect("json") + "\n";
        std::fs::write(dir.join(name), text).expect("write");
    };
    // A Llama-style config. The mocker reads vocab size and context length from it; the native
    // engine's fixtures add weights for this shape.
    write(
        "config.json",
        json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": vocab,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "tie_word_embeddings": false,
            "torch_dtype": "float32",
            "bos_token_id": id("<|begin_of_text|>"),
            "eos_token_id": [id("<|eot_id|>"), id("<|end_of_text|>")],
        }),
    );
    write(
        "tokenizer_config.json",
        json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<|begin_of_text|>",
            "eos_token": "<|eot_id|>",
            "model_max_length": 4096,
            "clean_up_tokenization_spaces": false,
            "chat_template": CHAT_TEMPLATE,
        }),
    );
    write(
        "generation_config.json",
        json!({
            "bos_token_id": id("<|begin_of_text|>"),
            "eos_token_id": [id("<|eot_id|>"), id("<|end_of_text|>")],
            "temperature": 0.7,
            "top_p": 0.9,
        }),
    );
    println!("wrote {} (vocab {vocab})", dir.display());
}
