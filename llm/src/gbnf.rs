//! GBNF, llama.cpp's grammar dialect, for the one constraint a llama.cpp server has no field
//! for: forced tool calls ([`Calls`]), whose JSON sits between fixed markup. llama.cpp converts
//! a JSON Schema only for a whole answer (its `json_schema` field), so the schemas inside calls
//! are converted here.
//!
//! Written here rather than taken from a crate: the Rust converters on crates.io (`gbnf` 0.2)
//! make every property required, and llama.cpp's own converter is C++ reachable only through
//! that field. It covers what tool parameters use: types, properties (required or optional),
//! `enum`/`const`, `anyOf`/`oneOf`, arrays with item counts, string lengths, non-negative
//! numbers, local `$ref`s. Any other keyword that constrains a value is an error naming it,
//! never a looser grammar; `format` is an annotation, as JSON Schema defines it by default.
//! JSON is written compactly (`, ` and `: `), as llguidance writes it for native workers.

use std::collections::HashMap;

use serde_json::Value;

use dyn_protocol::types::Calls;

/// Keywords that describe a value without constraining it.
const ANNOTATIONS: &[&str] = &[
    "title",
    "description",
    "default",
    "examples",
    "$schema",
    "$id",
    "$comment",
    "$defs",
    "definitions",
    "deprecated",
    "readOnly",
    "writeOnly",
    "format",
];

/// The largest count a repetition may have here (llama.cpp refuses 2,000 and more).
const MAX_REPEAT: u64 = 1000;

/// The deepest a schema may nest, counting `$ref`s followed: the conversion recurses, and a
/// chain of references is not bounded by the JSON parser's own nesting limit.
const MAX_DEPTH: usize = 64;

/// The longest grammar written: past it, a schema is refused rather than sent.
const MAX_GRAMMAR: usize = 256 << 10;

/// JSON's own rules, named `json-*`, which the converted schemas build on.
const JSON_RULES: &str = r#"json-char ::= [^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4})
json-string ::= "\"" json-char* "\""
json-natural ::= "0" | [1-9] [0-9]*
json-integer ::= "-"? json-natural
json-fraction ::= ("." [0-9]+)? ([eE] [-+]? [0-9]+)?
json-number ::= json-integer json-fraction
json-value ::= json-object | json-array | json-string | json-number | "true" | "false" | "null"
json-object ::= "{" (json-string ": " json-value (", " json-string ": " json-value)*)? "}"
json-array ::= "[" (json-value (", " json-value)*)? "]"
"#;

/// Forced calls as a GBNF grammar (`root` is the start), or what in their schemas GBNF here
/// cannot say.
pub fn calls(c: &Calls) -> Result<String, String> {
    let mut b = Builder::default();
    let mut forms = Vec::new();
    for f in &c.forms {
        b.root = f.schema.clone();
        b.refs.clear();
        let value = b.schema(&f.schema)?;
        forms.push(seq(&[lit(&f.before), value, lit(&f.after)]));
    }
    let more = match &c.sep {
        Some(sep) => format!("({})*", seq(&[lit(sep), "call".into()])),
        None => String::new(),
    };
    let root = seq(&[lit(&c.open), "call".into(), more, lit(&c.close)]);
    let mut out = format!("root ::= {root}\ncall ::= {}\n", forms.join(" | "));
    for (name, body) in &b.rules {
        out.push_str(&format!("{name} ::= {body}\n"));
    }
    out.push_str(JSON_RULES);
    if out.len() > MAX_GRAMMAR {
        return Err(format!(
            "so many properties that the grammar passes {} KiB",
            MAX_GRAMMAR >> 10
        ));
    }
    Ok(out)
}

/// A grammar matching exactly one of `options` (a structured output's `choice`).
pub fn choice(options: &[String]) -> String {
    let alts: Vec<String> = options
        .iter()
        .map(|o| if o.is_empty() { "\"\"".into() } else { lit(o) })
        .collect();
    format!("root ::= {}", alts.join(" | "))
}

/// A GBNF string literal for `s` (empty for empty text, which a sequence leaves out).
fn lit(s: &str) -> String {
    if s.is_empty() {
        return String::new();
    }
    let mut out = String::from("\"");
    for ch in s.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 || c as u32 == 0x7F => {
                out.push_str(&format!("\\x{:02X}", c as u32));
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Items in a row, the empty ones left out (Lark writes them so too).
pub(crate) fn seq(items: &[String]) -> String {
    let parts: Vec<&str> = items
        .iter()
        .map(String::as_str)
        .filter(|s| !s.is_empty())
        .collect();
    parts.join(" ")
}

/// A JSON value written as literal text (`const`, `enum`).
fn json_lit(v: &Value) -> String {
    lit(&compact(v))
}

/// `v` in the compact form the grammar writes (`, ` and `: `).
fn compact(v: &Value) -> String {
    match v {
        Value::Array(items) => format!(
            "[{}]",
            items.iter().map(compact).collect::<Vec<_>>().join(", ")
        ),
        Value::Object(o) => format!(
            "{{{}}}",
            o.iter()
                .map(|(k, v)| format!("{}: {}", Value::from(k.as_str()), compact(v)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        other => other.to_string(),
    }
}

#[derive(Default)]
struct Builder {
    rules: Vec<(String, String)>,
    /// The schema `$ref`s resolve in.
    root: Value,
    /// Rules already made for a `$ref` (recursive schemas refer to them while being made).
    refs: HashMap<String, String>,
    /// Schemas being converted now, one inside the other.
    depth: usize,
}

impl Builder {
    fn rule(&mut self, body: String) -> String {
        let name = format!("s{}", self.rules.len());
        self.rules.push((name.clone(), body));
        name
    }

    /// A rule matching what `s` allows.
    fn schema(&mut self, s: &Value) -> Result<String, String> {
        if self.depth >= MAX_DEPTH {
            return Err(format!(
                "a schema nested deeper than {MAX_DEPTH} levels (references included)"
            ));
        }
        self.depth += 1;
        let rule = self.schema_at_depth(s);
        self.depth -= 1;
        rule
    }

    fn schema_at_depth(&mut self, s: &Value) -> Result<String, String> {
        let o = match s {
            Value::Bool(true) => return Ok("json-value".into()),
            Value::Object(o) => o,
            other => return Err(format!("a schema must be an object, not {other}")),
        };
        // What a reference, a constant, a choice or a combination says is all that is said:
        // a constraint beside it would be dropped, so it is refused instead.
        let whole = ["$ref", "const", "enum", "anyOf", "oneOf", "allOf"];
        if let Some(w) = whole.iter().find(|w| o.contains_key(**w))
            && let Some(k) = o.keys().find(|k| {
                !(ANNOTATIONS.contains(&k.as_str())
                    || k.starts_with("x-")
                    || *k == "type"
                    || whole.contains(&k.as_str()))
            })
        {
            return Err(format!("the keyword {k:?} beside {w:?}"));
        }
        if let Some(r) = o.get("$ref") {
            return self.reference(r);
        }
        if let Some(v) = o.get("const") {
            return Ok(self.rule(json_lit(v)));
        }
        if let Some(options) = o.get("enum") {
            let options = options.as_array().ok_or("enum must be an array")?;
            if options.is_empty() {
                return Err("enum has no options".into());
            }
            let alts: Vec<String> = options.iter().map(json_lit).collect();
            return Ok(self.rule(alts.join(" | ")));
        }
        for key in ["anyOf", "oneOf"] {
            if let Some(branches) = o.get(key) {
                let branches = branches
                    .as_array()
                    .filter(|b| !b.is_empty())
                    .ok_or_else(|| format!("{key} must be a non-empty array"))?;
                let alts = branches
                    .iter()
                    .map(|b| self.schema(b))
                    .collect::<Result<Vec<_>, _>>()?;
                return Ok(self.rule(alts.join(" | ")));
            }
        }
        if let Some([one]) = o.get("allOf").and_then(Value::as_array).map(Vec::as_slice) {
            return self.schema(one);
        }
        let types: Vec<&str> = match o.get("type") {
            Some(Value::String(t)) => vec![t.as_str()],
            Some(Value::Array(ts)) => ts
                .iter()
                .map(|t| t.as_str().ok_or_else(|| format!("the type {t}")))
                .collect::<Result<_, _>>()?,
            Some(other) => return Err(format!("type must be a string or array, not {other}")),
            None if o.contains_key("properties") => vec!["object"],
            None if o.contains_key("items") => vec!["array"],
            None => vec![],
        };
        let known = |k: &str| {
            ANNOTATIONS.contains(&k)
                || k.starts_with("x-")
                || k == "type"
                || types.iter().any(|t| keywords(t).contains(&k))
        };
        if let Some(k) = o.keys().find(|k| !known(k)) {
            return Err(format!("the keyword {k:?}"));
        }
        if types.is_empty() {
            return Ok("json-value".into());
        }
        let alts = types
            .iter()
            .map(|t| self.typed(t, o))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(self.rule(alts.join(" | ")))
    }

    fn reference(&mut self, r: &Value) -> Result<String, String> {
        let path = r.as_str().ok_or("$ref must be a string")?;
        if let Some(name) = self.refs.get(path) {
            return Ok(name.clone());
        }
        let target = path
            .strip_prefix('#')
            .and_then(|p| self.root.pointer(p))
            .cloned()
            .ok_or_else(|| format!("the $ref {path:?} (only references inside the schema)"))?;
        // Named before it is made, so that a recursive schema refers to itself.
        let name = self.rule(String::new());
        self.refs.insert(path.to_string(), name.clone());
        let body = self.schema(&target)?;
        // A schema that is itself before any text loops in GBNF (left recursion).
        if body
            .split(" | ")
            .any(|alt| alt.split(' ').next() == Some(name.as_str()))
        {
            return Err(format!(
                "the $ref {path:?}, which refers to itself before any text"
            ));
        }
        if let Some(slot) = self.rules.iter_mut().find(|(n, _)| *n == name) {
            slot.1 = body;
        }
        Ok(name)
    }

    fn typed(&mut self, t: &str, o: &serde_json::Map<String, Value>) -> Result<String, String> {
        // llama.cpp expands a repetition into rules and refuses one of 2,000 or more.
        let count = |k: &str| -> Result<Option<u64>, String> {
            match o.get(k) {
                None => Ok(None),
                Some(v) => match v.as_u64() {
                    Some(n) if n <= MAX_REPEAT => Ok(Some(n)),
                    Some(n) => Err(format!(
                        "the {k} {n} (llama.cpp takes at most {MAX_REPEAT})"
                    )),
                    None => Err(format!("the {k} {v} (a whole number, please)")),
                },
            }
        };
        match t {
            "string" => Ok(match (count("minLength")?, count("maxLength")?) {
                (Some(min), Some(max)) if min > max => {
                    return Err("maxLength below minLength".into());
                }
                (None, None) => "json-string".into(),
                (min, max) => match rep(min.unwrap_or(0), max) {
                    Some(r) => format!("\"\\\"\" json-char{r} \"\\\"\""),
                    None => "\"\\\"\\\"\"".into(),
                },
            }),
            "integer" | "number" => {
                let tail = if t == "number" { " json-fraction" } else { "" };
                match o.get("minimum").and_then(Value::as_f64) {
                    None => Ok(format!("json-integer{tail}")),
                    Some(0.0) => Ok(format!("json-natural{tail}")),
                    Some(1.0) if t == "integer" => Ok("[1-9] [0-9]*".into()),
                    Some(m) => Err(format!("the minimum {m} (only 0, or 1 for integers)")),
                }
            }
            "boolean" => Ok("(\"true\" | \"false\")".into()),
            "null" => Ok("\"null\"".into()),
            "object" => self.object(o),
            "array" => {
                let item = match o.get("items") {
                    Some(s) => self.schema(s)?,
                    None => "json-value".into(),
                };
                let min = count("minItems")?.unwrap_or(0);
                let max = count("maxItems")?;
                if max.is_some_and(|m| m < min) {
                    return Err("maxItems below minItems".into());
                }
                let more = match rep(min.saturating_sub(1), max.map(|m| m.saturating_sub(1))) {
                    Some(r) => format!(" (\", \" {item}){r}"),
                    None => String::new(),
                };
                let items = format!("{item}{more}");
                Ok(match (min, max) {
                    (_, Some(0)) => "\"[]\"".into(),
                    (0, _) => format!("\"[\" ({items})? \"]\""),
                    _ => format!("\"[\" {items} \"]\""),
                })
            }
            other => Err(format!("the type {other:?}")),
        }
    }

    /// An object: the listed properties, required ones first, then each optional one or
    /// not; with none listed, any keys whose values match `additionalProperties`.
    fn object(&mut self, o: &serde_json::Map<String, Value>) -> Result<String, String> {
        let empty = serde_json::Map::new();
        let props = o
            .get("properties")
            .and_then(Value::as_object)
            .unwrap_or(&empty);
        let required: Vec<&str> = o
            .get("required")
            .and_then(Value::as_array)
            .map(|r| r.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        if props.is_empty() && required.is_empty() {
            let value = match o.get("additionalProperties") {
                Some(Value::Bool(false)) => return Ok("\"{}\"".into()),
                Some(s @ Value::Object(_)) => self.schema(s)?,
                _ => "json-value".into(),
            };
            return Ok(format!(
                "\"{{\" (json-string \": \" {value} (\", \" json-string \": \" {value})*)? \"}}\""
            ));
        }
        let pair = |b: &mut Self, key: &str| -> Result<String, String> {
            let value = match props.get(key) {
                Some(s) => b.schema(s)?,
                None => "json-value".into(),
            };
            Ok(format!(
                "{} {value}",
                lit(&format!("{}: ", Value::from(key)))
            ))
        };
        let mut req = Vec::new();
        for key in &required {
            req.push(pair(self, key)?);
        }
        let mut opt = Vec::new();
        for key in props.keys().filter(|k| !required.contains(&k.as_str())) {
            opt.push(pair(self, key)?);
        }
        let body = if req.is_empty() {
            // No key is certain: the first one present opens the list. From the last key
            // back, `rest` is "each of the keys after this one, after a comma, or not" and
            // `first` "at least one of the keys from this one on": one rule each per key, so
            // the grammar grows with the keys, not with their square.
            let mut rest = String::new();
            let mut first: Option<String> = None;
            for (i, p) in opt.iter().enumerate().rev() {
                let this = seq(&[p.clone(), rest.clone()]);
                first = Some(self.rule(match first {
                    Some(later) => format!("{this} | {later}"),
                    None => this,
                }));
                if i > 0 {
                    rest = self.rule(seq(&[format!("(\", \" {p})?"), rest]));
                }
            }
            format!("({})?", first.unwrap_or_default())
        } else {
            let rest: Vec<String> = opt.iter().map(|q| format!("(\", \" {q})?")).collect();
            seq(&[req.join(" \", \" "), rest.join(" ")])
        };
        Ok(format!("\"{{\" {body} \"}}\""))
    }
}

/// GBNF's repetition of `min` to `max` (unbounded: `None`) times; `None` for none at all.
fn rep(min: u64, max: Option<u64>) -> Option<String> {
    Some(match (min, max) {
        (_, Some(0)) => return None,
        (0, None) => "*".into(),
        (1, None) => "+".into(),
        (m, None) => format!("{{{m},}}"),
        (m, Some(n)) if m == n => format!("{{{m}}}"),
        (m, Some(n)) => format!("{{{m},{n}}}"),
    })
}

/// What each type's values may be constrained by here.
fn keywords(t: &str) -> &'static [&'static str] {
    match t {
        "string" => &["minLength", "maxLength"],
        "integer" | "number" => &["minimum"],
        "object" => &["properties", "required", "additionalProperties"],
        "array" => &["items", "minItems", "maxItems"],
        _ => &[],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dyn_protocol::types::CallForm;
    use serde_json::json;

    fn one(schema: Value) -> Result<String, String> {
        calls(&Calls {
            open: String::new(),
            close: String::new(),
            sep: None,
            forms: vec![CallForm {
                before: String::new(),
                schema,
                after: String::new(),
            }],
        })
    }

    fn rules(g: &str) -> HashMap<&str, &str> {
        g.lines().filter_map(|l| l.split_once(" ::= ")).collect()
    }

    #[test]
    fn markup_and_repeats_around_the_json() {
        let g = calls(&Calls {
            open: "[TOOL_CALLS][".into(),
            close: "]".into(),
            sep: Some(", ".into()),
            forms: vec![CallForm {
                before: "<tool_call>\n".into(),
                schema: json!({"type": "object", "properties": {"a": {"type": "integer"}},
                               "required": ["a"]}),
                after: "\n\"x\"\\".into(),
            }],
        })
        .unwrap();
        let r = rules(&g);
        assert_eq!(r["root"], r#""[TOOL_CALLS][" call (", " call)* "]""#);
        assert_eq!(r["call"], r#""<tool_call>\n" s1 "\n\"x\"\\""#);
        assert_eq!(r["s0"], r#"json-integer"#);
        assert_eq!(r["s1"], r#""{" "\"a\": " s0 "}""#);
    }

    #[test]
    fn required_first_then_each_optional_key_or_not() {
        let g = one(json!({"type": "object", "properties": {
            "unit": {"enum": ["c", "f"]}, "city": {"type": "string", "maxLength": 20},
            "days": {"type": "integer", "minimum": 1}}, "required": ["city"]}))
        .unwrap();
        let r = rules(&g);
        assert_eq!(r["s0"], r#""\"" json-char{0,20} "\"""#);
        assert_eq!(r["s1"], r#""\"c\"" | "\"f\"""#);
        assert_eq!(
            r["s3"],
            r#""{" "\"city\": " s0 (", " "\"unit\": " s1)? (", " "\"days\": " s2)? "}""#
        );
        // None required: whichever key comes first has no comma before it.
        let g =
            one(json!({"properties": {"a": {"type": "boolean"}, "b": {"type": "null"}}})).unwrap();
        let r = rules(&g);
        assert_eq!(r["s2"], r#""\"b\": " s1"#);
        assert_eq!(r["s3"], r#"(", " "\"b\": " s1)?"#);
        assert_eq!(r["s4"], r#""\"a\": " s0 s3 | s2"#);
        assert_eq!(r["s5"], r#""{" (s4)? "}""#);
    }

    #[test]
    fn arrays_refs_and_alternatives() {
        let g = one(json!({"$defs": {"n": {"anyOf": [{"type": "null"},
                           {"type": "array", "items": {"$ref": "#/$defs/n"}, "minItems": 2, "maxItems": 3}]}},
                           "$ref": "#/$defs/n"}))
        .unwrap();
        let r = rules(&g);
        assert_eq!(r["s0"], "s3");
        assert_eq!(r["s2"], r#""[" s0 (", " s0){1,2} "]""#);
        assert_eq!(r["s3"], "s1 | s2");
        assert!(
            one(json!({"type": "array", "maxItems": 0}))
                .unwrap()
                .contains("\"[]\"")
        );
        let g = one(json!({"type": "array", "items": {"type": "null"}, "maxItems": 1})).unwrap();
        assert_eq!(rules(&g)["s1"], r#""[" (s0)? "]""#);
        let g = one(json!({"type": "array", "items": {"type": "null"}})).unwrap();
        assert_eq!(rules(&g)["s1"], r#""[" (s0 (", " s0)*)? "]""#);
        let g = one(json!({"type": ["string", "null"], "const": {"a": [1, 2]}})).unwrap();
        assert_eq!(rules(&g)["s0"], r#""{\"a\": [1, 2]}""#);
    }

    #[test]
    fn what_it_cannot_say_is_an_error_naming_it() {
        for (schema, named) in [
            (json!({"type": "string", "pattern": "^a$"}), "pattern"),
            (json!({"type": "integer", "maximum": 3}), "maximum"),
            (json!({"type": "integer", "minimum": 5}), "minimum 5"),
            (json!({"$ref": "http://x/y"}), "http://x/y"),
            (json!({"type": "array", "uniqueItems": true}), "uniqueItems"),
            (json!({"allOf": [{}, {}]}), "allOf"),
            (json!(3), "3"),
            (
                json!({"type": "string", "maxLength": 5000}),
                "maxLength 5000",
            ),
            (
                json!({"type": "string", "maxLength": 10.5}),
                "maxLength 10.5",
            ),
            (
                json!({"type": "string", "minLength": 4, "maxLength": 2}),
                "below minLength",
            ),
            (
                json!({"anyOf": [{"type": "string"}], "maxLength": 3}),
                "\"maxLength\" beside",
            ),
            (json!({"type": ["string", 3]}), "the type 3"),
            (json!({"$ref": "#"}), "refers to itself"),
            // A long chain of references is refused, not followed down the stack.
            (
                json!({"$ref": "#/$defs/d0", "$defs": (0..5000)
                    .map(|i| (format!("d{i}"), json!({"$ref": format!("#/$defs/d{}", i + 1)})))
                    .collect::<serde_json::Map<String, Value>>()}),
                "deeper than 64",
            ),
        ] {
            let e = one(schema).unwrap_err();
            assert!(e.contains(named), "{e}");
        }
        // Annotations are not constraints.
        one(json!({"type": "string", "format": "date", "description": "d", "x-y": 1})).unwrap();
        // Many optional keys: the grammar grows with them, not with their square, and past a
        // bound it is refused rather than written.
        let props = |n: usize| {
            let p: serde_json::Map<String, Value> = (0..n)
                .map(|i| (format!("k{i}"), json!({"type": "integer"})))
                .collect();
            json!({"type": "object", "properties": p})
        };
        let (small, large) = (one(props(100)).unwrap(), one(props(1000)).unwrap());
        assert!(
            large.len() < small.len() * 12,
            "{} vs {}",
            small.len(),
            large.len()
        );
        assert!(one(props(20_000)).unwrap_err().contains("KiB"));
    }
}
