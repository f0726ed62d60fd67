//! Fixtures shared by the unit tests of several kinds.

use dyn_core::BuildCx;
use dyn_core::planes::Planes;

use crate::types::{OutputSpec, PreprocessedRequest, Sampling, StopConditions};

/// A build context for `node` with the repository's tiny model, on `planes`.
pub fn cx(node: &str, instance_id: u64, consumers: &[&str], planes: &Planes) -> BuildCx {
    let model = dyn_core::ModelSpec {
        name: "tiny".into(),
        path: concat!(env!("CARGO_MANIFEST_DIR"), "/../models/tiny").into(),
        tool_parser: None,
        reasoning_parser: None,
        loras: Default::default(),
    };
    BuildCx {
        instance_id: instance_id.into(),
        consumers: consumers.iter().map(|c| c.to_string()).collect(),
        model: Some(model.clone()),
        models: vec![model],
        ..BuildCx::for_tests(node, planes.clone())
    }
}

/// A tokenized request for the tiny model with seed 5.
pub fn preprocessed(tokens: Vec<u32>, max_tokens: u32) -> PreprocessedRequest {
    PreprocessedRequest {
        model: "tiny".into(),
        token_ids: tokens,
        sampling: Sampling {
            seed: Some(5),
            ..Sampling::default()
        },
        routing: Default::default(),
        stop: StopConditions {
            max_tokens,
            min_tokens: 0,
            ignore_eos: false,
            eos_token_ids: vec![],
            stop_token_ids: vec![],
        },
        output: OutputSpec::default(),
        target: None,
        cached_tokens: 0,
        prefilled: None,
        hashes: Default::default(),
    }
}

/// A forced call of `get_weather` in Hermes markup (`<tool_call>\n{…}\n</tool_call>`, as
/// Qwen's and SmolLM2's templates write calls) whose `city` argument is `city` (a JSON
/// Schema): everything but the city's value is forced text.
pub fn weather_call(city: serde_json::Value) -> crate::types::Constraint {
    use crate::types::{CallForm, Calls, Constraint};
    let schema = serde_json::json!({
        "type": "object",
        "properties": {"name": {"const": "get_weather"}, "arguments": {
            "type": "object",
            "properties": {"city": city},
            "required": ["city"], "additionalProperties": false}},
        "required": ["name", "arguments"], "additionalProperties": false,
    });
    Constraint::Calls(Calls {
        open: String::new(),
        close: String::new(),
        sep: None,
        forms: vec![CallForm {
            before: "<tool_call>\n".into(),
            schema,
            after: "\n</tool_call>".into(),
        }],
    })
}
