//! Unit tests of the OpenAI dialect's request reading and answer shaping.

use super::request::*;
use super::stream::*;
use super::*;
use dyn_protocol::types::Constraint;

#[test]
fn fields_not_honoured_yet_are_refused_by_name_and_their_defaults_pass() {
    let refused = |extra: Value| {
        let mut body = json!({"model": "m", "messages": []});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let b: ChatBody = serde_json::from_value(body).unwrap();
        refuse_unsupported(&b.common.unsupported)
            .err()
            .map(|e| e.param.unwrap_or_default())
    };
    // What clients send by default asks for nothing.
    let defaults = json!({"tools": [], "tool_choice": "none", "response_format": {"type": "text"},
        "logit_bias": {}, "presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
        "min_p": 0, "stop_token_ids": [], "top_logprobs": null, "parallel_tool_calls": true,
        "suffix": "", "best_of": 1, "modalities": ["text"], "store": false, "service_tier": "auto",
        "user": "u", "metadata": {"a": "b"}, "include_stop_str_in_output": false,
        "skip_special_tokens": true, "chat_template_kwargs": {}, "add_generation_prompt": true,
        "continue_final_message": false, "prompt_logprobs": null, "use_beam_search": false,
        "bad_words": [], "allowed_token_ids": null, "echo": false});
    assert_eq!(refused(defaults), None);
    for (extra, param) in [
        (json!({"functions": [{"name": "f"}]}), "functions"),
        (json!({"suffix": "}"}), "suffix"),
        (json!({"best_of": 3}), "best_of"),
        (json!({"reasoning_effort": "high"}), "reasoning_effort"),
        (json!({"modalities": ["text", "audio"]}), "modalities"),
        (
            json!({"include_stop_str_in_output": true}),
            "include_stop_str_in_output",
        ),
        (
            json!({"chat_template_kwargs": {"enable_thinking": false}}),
            "chat_template_kwargs",
        ),
        (json!({"prompt_logprobs": 1}), "prompt_logprobs"),
        (json!({"allowed_token_ids": [1, 2]}), "allowed_token_ids"),
        (json!({"echo": true}), "echo"),
    ] {
        assert_eq!(refused(extra).as_deref(), Some(param));
    }
}

#[test]
fn structured_outputs_are_read_from_each_dialect_and_bad_ones_named() {
    let read = |extra: Value| {
        let mut body = json!({"model": "m", "messages": []});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let b: ChatBody = serde_json::from_value(body).unwrap();
        constraint(&b.common).map_err(|e| e.param.unwrap_or_default())
    };
    let schema = json!({"type": "object"});
    for (extra, want) in [
        (json!({"response_format": {"type": "text"}}), None),
        (
            json!({"response_format": {"type": "json_object"}}),
            Some(Constraint::JsonObject),
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}}}),
            Some(Constraint::JsonSchema(schema.clone())),
        ),
        (
            json!({"structured_outputs": {"regex": "a+"}}),
            Some(Constraint::Regex("a+".into())),
        ),
        (
            json!({"structured_outputs": {"choice": ["a", "b"]}}),
            Some(Constraint::Choice(vec!["a".into(), "b".into()])),
        ),
        (
            json!({"guided_json": "{\"type\": \"object\"}"}),
            Some(Constraint::JsonSchema(schema.clone())),
        ),
        (
            json!({"guided_grammar": "start: \"x\""}),
            Some(Constraint::Lark("start: \"x\"".into())),
        ),
    ] {
        assert_eq!(read(extra.clone()), Ok(want), "{extra}");
    }
    for (extra, param) in [
        (
            json!({"response_format": {"type": "xml"}}),
            "response_format.type",
        ),
        (
            json!({"response_format": {"type": "json_schema"}}),
            "response_format.json_schema.schema",
        ),
        (
            json!({"structured_outputs": {"choice": []}}),
            "structured_outputs.choice",
        ),
        (
            json!({"structured_outputs": {"structural_tag": "x"}}),
            "structured_outputs.structural_tag",
        ),
        (
            json!({"response_format": {"type": "json_object"}, "guided_regex": "a"}),
            "guided_regex",
        ),
    ] {
        assert_eq!(read(extra.clone()), Err(param.to_string()), "{extra}");
    }
}

#[test]
fn stop_accepts_a_string_or_a_list_and_names_what_it_expected() {
    let c: Common = serde_json::from_str(r#"{"model": "m", "stop": "x"}"#).expect("one");
    assert!(matches!(c.stop, Some(StopIn::One(_))));
    let c: Common = serde_json::from_str(r#"{"model": "m", "stop": ["x", "y"]}"#).expect("many");
    assert!(matches!(c.stop, Some(StopIn::Many(v)) if v.len() == 2));
    let e = serde_json::from_str::<Common>(r#"{"model": "m", "stop": 3}"#).expect_err("bad");
    assert!(
        e.to_string().contains("a string or a list of strings"),
        "{e}"
    );
}

#[test]
fn content_is_a_string_or_parts_and_names_what_it_expected() {
    let m: MessageIn =
        serde_json::from_str(r#"{"role": "user", "content": "h\u00e9 \"q\""}"#).expect("text");
    assert!(matches!(m.content, Some(ContentIn::Text(t)) if t == "hé \"q\""));
    let m: MessageIn = serde_json::from_str(
        r#"{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}"#,
    )
    .expect("parts");
    assert!(matches!(m.content, Some(ContentIn::Parts(p)) if p.len() == 2));
    let m: MessageIn = serde_json::from_str(r#"{"role": "user", "content": null}"#).expect("none");
    assert!(m.content.is_none());
    let e =
        serde_json::from_str::<MessageIn>(r#"{"role": "user", "content": 3}"#).expect_err("bad");
    assert!(
        e.to_string()
            .contains("a string or a list of content parts"),
        "{e}"
    );
}

#[test]
fn chunks_have_openai_shapes() {
    let s = Shape {
        id: "chatcmpl-1".into(),
        endpoint: Endpoint::Chat,
        model: "tiny".into(),
        created: 5,
    };
    let c = s.delta("hi", None, true);
    assert_eq!(c["object"], "chat.completion.chunk");
    assert_eq!(c["choices"][0]["delta"]["content"], "hi");
    assert!(c["usage"].is_null() && c.get("usage").is_some());
    let u = s.usage_chunk(Usage {
        prompt_tokens: 3,
        completion_tokens: 4,
    });
    assert_eq!(u["choices"], json!([]));
    assert_eq!(u["usage"]["total_tokens"], 7);
    let f = s.full("hey", Some(FinishReason::Length), Usage::default());
    assert_eq!(f["choices"][0]["message"]["content"], "hey");
    assert_eq!(f["choices"][0]["finish_reason"], "length");
}

#[test]
fn streamed_chunks_are_the_json_values_they_replace() {
    for endpoint in [Endpoint::Chat, Endpoint::Completion] {
        let s = Shape {
            id: "chatcmpl-\"quoted\"-1".into(),
            endpoint,
            model: "tiny/\u{e9}\\model".into(),
            created: 1_795_448_917,
        };
        for include_usage in [false, true] {
            let chunks = Chunks::new(&s, include_usage);
            for text in ["", "hi", " \"quote\" \\ back\nline\t\u{1}", "日本語 🙂"] {
                for finish in [None, Some(FinishReason::Stop), Some(FinishReason::Length)] {
                    let want = event(&s.delta(text, finish, include_usage).to_string());
                    assert_eq!(
                        chunks.delta(text, finish),
                        want,
                        "{endpoint:?} {text:?} {finish:?} usage {include_usage}"
                    );
                }
            }
            if endpoint == Endpoint::Chat {
                let role = s.chunk(
                    Some(json!({"role": "assistant", "content": ""})),
                    None,
                    include_usage,
                );
                assert_eq!(chunks.role(), event(&role.to_string()));
            }
        }
    }
}
