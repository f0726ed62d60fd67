//! Bounds on a constraint before anything compiles it. llguidance's compilers (JSON Schema,
//! Lark, regex) and dyn's GBNF writer recurse once per nested schema, per `$ref` followed and
//! per rule referenced, and a stack overflow aborts the whole process (`catch_unwind` cannot
//! catch it): a 19 KB schema chaining 300 `$ref`s was enough on a 2 MiB thread. So every
//! constraint is measured here first — the depth of its schema, reference and rule graph, the
//! nesting of its expressions, its size — by loops and bounded recursions of this module's own,
//! and refused with a message that names the limit; what passes compiles on threads whose stack
//! is many times what the bounds allow ([`super::compile`]).
//!
//! Depth counts what the compilers recurse on: a schema inside another (`properties`, `items`,
//! `anyOf`, …) or reached by a `$ref` is one level deeper; a Lark rule is one level deeper than
//! the deepest rule or parenthesis in its body. A reference back to a schema or rule already
//! being walked costs nothing (recursive grammars are compiled as references, not unrolled).

use std::collections::HashMap;

use serde_json::{Map, Value};

use dyn_protocol::types::Constraint;

/// Nested schemas, `$ref`s included (the GBNF writer's bound too).
pub const MAX_SCHEMA_DEPTH: usize = 64;
/// Rules referenced one inside the other in a Lark grammar, parentheses included, and
/// parentheses in a regular expression.
pub const MAX_RULE_DEPTH: usize = 128;
/// The constraint's text: a schema as JSON, a grammar, a regex, the choices together.
pub const MAX_CONSTRAINT_BYTES: usize = 512 << 10;
/// Strings in a choice.
pub const MAX_CHOICES: usize = 4096;
/// `$ref`s in a schema. A backstop under the depth measure: however references resolve, a
/// chain of them is no longer than this (a few MiB of the compiler's stack at most).
pub const MAX_REFS: usize = 1000;
/// Steps the measures below may take (schemas and rules visited): they are linear in the
/// constraint for most shapes, and this ends the others.
const MAX_STEPS: usize = 200_000;

/// `Err` names the bound `c` exceeds.
pub fn check(c: &Constraint) -> Result<(), String> {
    match c {
        Constraint::JsonObject => Ok(()),
        Constraint::JsonSchema(s) => {
            size(serde_json::to_string(s).map_or(usize::MAX, |t| t.len()))?;
            schema_depth(s)
        }
        Constraint::Regex(rx) => {
            size(rx.len())?;
            nesting(rx, "regular expression")
        }
        Constraint::Choice(options) => {
            if options.len() > MAX_CHOICES {
                return Err(format!(
                    "a choice of {} strings is more than the {MAX_CHOICES} allowed",
                    options.len()
                ));
            }
            size(options.iter().map(String::len).sum())
        }
        Constraint::Lark(g) => {
            size(g.len())?;
            lark_depth(g)
        }
        Constraint::Calls(calls) => {
            let mut bytes = calls.open.len() + calls.close.len();
            for f in &calls.forms {
                bytes += serde_json::to_string(&f.schema).map_or(usize::MAX / 2, |t| t.len());
                bytes += f.before.len() + f.after.len();
                schema_depth(&f.schema)?;
            }
            size(bytes)
        }
    }
}

fn size(bytes: usize) -> Result<(), String> {
    if bytes > MAX_CONSTRAINT_BYTES {
        return Err(format!(
            "the output grammar is {bytes} bytes, more than the {MAX_CONSTRAINT_BYTES} allowed"
        ));
    }
    Ok(())
}

fn too_deep_schema() -> String {
    format!("the schema nests deeper than {MAX_SCHEMA_DEPTH} levels ($ref included)")
}

/// Keywords whose value is one schema, a map of schemas, or a list of schemas.
const ONE: &[&str] = &[
    "additionalProperties",
    "additionalItems",
    "unevaluatedProperties",
    "unevaluatedItems",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
    "contentSchema",
];
const MAP: &[&str] = &["properties", "patternProperties", "dependentSchemas"];
const LIST: &[&str] = &["anyOf", "oneOf", "allOf", "prefixItems"];

/// The deepest chain of schemas in `root`, following `$ref`s into `root` (by JSON pointer or
/// `$anchor`). What would make llguidance resolve a reference elsewhere than this walk does is
/// refused: a `$ref` outside the document or percent-encoded, an `$id` below the root (it moves
/// the base references resolve against), an anchor named twice.
fn schema_depth(root: &Value) -> Result<(), String> {
    let mut walk = SchemaWalk {
        root,
        anchors: HashMap::new(),
        refs: 0,
        done: HashMap::new(),
        walking: Vec::new(),
        steps: 0,
        cut: false,
    };
    walk.survey(root, 0)?;
    walk.depth(root, 1).map(drop)
}

struct SchemaWalk<'a> {
    root: &'a Value,
    /// `$anchor` name → the schema holding it.
    anchors: HashMap<&'a str, &'a Value>,
    /// The depth below each `$ref` target already measured (memoized: a schema whose
    /// definitions each refer to the next twice is measured once per definition, not 2^n times).
    done: HashMap<String, usize>,
    /// The `$ref`s being followed now: a reference back to one of them costs nothing.
    walking: Vec<String>,
    /// `$ref`s in the document.
    refs: usize,
    steps: usize,
    /// A reference back to a schema being walked was cut short below the current one.
    cut: bool,
}

impl<'a> SchemaWalk<'a> {
    /// Anchors anywhere in the document, `$ref`s counted, and what this walk cannot resolve
    /// as llguidance does refused (the walk stops at the JSON parser's own nesting bound, 128,
    /// far below any stack's).
    fn survey(&mut self, v: &'a Value, level: usize) -> Result<(), String> {
        if level > 256 {
            return Ok(());
        }
        match v {
            Value::Object(o) => {
                if let Some(Value::String(a)) = o.get("$anchor")
                    && self.anchors.insert(a.as_str(), v).is_some()
                {
                    return Err(format!("the $anchor {a:?} is named twice"));
                }
                if level > 0 && (o.contains_key("$id") || o.get("id").is_some_and(Value::is_string))
                {
                    return Err(
                        "an $id below the schema's root (references resolve against the root only)"
                            .into(),
                    );
                }
                if let Some(r) = o.get("$ref") {
                    self.refs += 1;
                    if self.refs > MAX_REFS {
                        return Err(format!("the schema has more than {MAX_REFS} $refs"));
                    }
                    if r.as_str().is_some_and(|r| r.contains('%')) {
                        return Err(format!(
                            "the $ref {r}: percent-encoded references are not supported"
                        ));
                    }
                }
                for c in o.values() {
                    self.survey(c, level + 1)?;
                }
            }
            Value::Array(a) => {
                for c in a {
                    self.survey(c, level + 1)?;
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// The levels `s` (at `level`) reaches, itself included; `Err` past the bound. Recursion
    /// here is bounded by [`MAX_SCHEMA_DEPTH`].
    fn depth(&mut self, s: &'a Value, level: usize) -> Result<usize, String> {
        if level > MAX_SCHEMA_DEPTH {
            return Err(too_deep_schema());
        }
        self.steps += 1;
        if self.steps > MAX_STEPS {
            return Err("the schema's references are too many to measure".into());
        }
        let Value::Object(o) = s else {
            return Ok(level);
        };
        let mut deepest = level;
        if let Some(r) = o.get("$ref") {
            deepest = deepest.max(self.reference(r, level)?);
        }
        for (k, v) in o {
            let children: Vec<&'a Value> = match (k.as_str(), v) {
                (k, v) if ONE.contains(&k) => vec![v],
                (k, Value::Object(m)) if MAP.contains(&k) => m.values().collect(),
                (k, Value::Array(a)) if LIST.contains(&k) => a.iter().collect(),
                ("items", Value::Array(a)) => a.iter().collect(),
                ("items", v) => vec![v],
                // Definitions count where they are used, through their `$ref`s: llguidance
                // compiles the ones that are referenced.
                _ => continue,
            };
            for c in children {
                deepest = deepest.max(self.depth(c, level + 1)?);
            }
        }
        Ok(deepest)
    }

    fn reference(&mut self, r: &Value, level: usize) -> Result<usize, String> {
        let path = r.as_str().ok_or("$ref must be a string")?;
        if self.walking.iter().any(|w| w == path) {
            self.cut = true;
            return Ok(level);
        }
        if let Some(below) = self.done.get(path) {
            let reached = level + below;
            return if reached > MAX_SCHEMA_DEPTH {
                Err(too_deep_schema())
            } else {
                Ok(reached)
            };
        }
        let target = self.resolve(path)?;
        self.walking.push(path.to_string());
        let outer = std::mem::take(&mut self.cut);
        let reached = self.depth(target, level + 1);
        self.walking.pop();
        let reached = reached?;
        // Measured from this reference: what it adds below `level`, kept unless a reference
        // back to a schema being walked was cut short inside it (entered from elsewhere, the
        // same schema may reach deeper).
        if !self.cut {
            self.done.insert(path.to_string(), reached - level);
        }
        self.cut |= outer;
        Ok(reached)
    }

    fn resolve(&self, path: &str) -> Result<&'a Value, String> {
        let unresolved = || {
            format!(
                "the $ref {path:?}: only references inside the schema (#/… or #anchor) are supported"
            )
        };
        let fragment = path.strip_prefix('#').ok_or_else(unresolved)?;
        if fragment.is_empty() || fragment.starts_with('/') {
            self.root.pointer(fragment).ok_or_else(unresolved)
        } else {
            self.anchors.get(fragment).copied().ok_or_else(unresolved)
        }
    }
}

/// `Err` when `text` nests parentheses deeper than [`MAX_RULE_DEPTH`].
fn nesting(text: &str, what: &str) -> Result<(), String> {
    if nesting_depth(text) > MAX_RULE_DEPTH {
        return Err(format!(
            "the {what} nests parentheses deeper than {MAX_RULE_DEPTH} levels"
        ));
    }
    Ok(())
}

fn too_deep_rules() -> String {
    format!("the grammar's rules nest deeper than {MAX_RULE_DEPTH} levels (parentheses included)")
}

/// A Lark grammar's deepest chain of rules, parentheses and regexes included; `%json`
/// schemas inside it are measured as schemas.
///
/// llguidance compiles a rule the first time it is referenced and returns at once for one
/// compiled or being compiled, starting from `start`: its recursion is the stack of one
/// depth-first walk from `start` in the order references are written, each rule entered once.
/// That walk is done here (then one from each rule `start` does not reach, which llguidance
/// does not compile: a bound that can only be higher), each reference one level below its rule
/// and its parentheses, so it takes time linear in the grammar.
fn lark_depth(g: &str) -> Result<(), String> {
    let (order, rules) = lark_rules(g)?;
    let mut walk = RuleWalk {
        rules: &rules,
        entered: std::collections::HashSet::new(),
    };
    let roots = std::iter::once("start").chain(order.iter().copied());
    for name in roots {
        if rules.contains_key(name) && !walk.entered.contains(name) {
            walk.depth(name, 1)?;
        }
    }
    Ok(())
}

/// A rule's body as what the walk needs: the names it refers to (in order, each with the
/// parentheses around it), and its own deepest parenthesis (or regex, or `%json` schema).
#[derive(Default)]
struct Body<'a> {
    refs: Vec<(&'a str, usize)>,
    own: usize,
}

/// Whether `c` continues a Lark name (llguidance's rules `[_?]?[a-z][_a-z0-9-]*` and terminals
/// `_?[A-Z][_A-Z0-9-]*`).
fn name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == '-'
}

/// The rules (and terminals) of `g`, in the order they are defined and by name. A line that
/// starts (after blanks) with a name (after `?`, `!` or both, before optional `{params}` and
/// `.priority`) and a colon starts a definition; the lines after it (alternatives,
/// continuations) belong to it.
#[allow(clippy::type_complexity)]
fn lark_rules(g: &str) -> Result<(Vec<&str>, HashMap<&str, Body<'_>>), String> {
    let mut rules: HashMap<&str, Body<'_>> = HashMap::new();
    let mut order = Vec::new();
    let mut current: Option<&str> = None;
    let mut parens = 0usize;
    let mut rest = g;
    let mut line_start = true;
    while !rest.is_empty() {
        let c = rest.chars().next().unwrap_or(' ');
        if line_start && let Some((name, after)) = definition(rest) {
            current = Some(name);
            if !rules.contains_key(name) {
                order.push(name);
            }
            rules.entry(name).or_default();
            parens = 0;
            rest = after;
            line_start = false;
            continue;
        }
        line_start = c == '\n';
        let step = c.len_utf8();
        match c {
            '"' => rest = skip_quoted(rest, '"'),
            '/' if rest.starts_with("//") => {
                rest = rest.find('\n').map_or("", |i| &rest[i..]);
            }
            '/' => {
                let end = quoted_len(rest, '/');
                let own = nesting_depth(&rest[..end]);
                if own > MAX_RULE_DEPTH {
                    return Err(too_deep_rules());
                }
                if let Some(b) = current.and_then(|n| rules.get_mut(n)) {
                    b.own = b.own.max(parens + own);
                }
                rest = &rest[end..];
            }
            '%' if rest.starts_with("%json") => {
                let after = rest["%json".len()..].trim_start();
                let mut values = serde_json::Deserializer::from_str(after).into_iter::<Value>();
                match values.next() {
                    Some(Ok(schema)) => {
                        schema_depth(&schema)?;
                        rest = &after[values.byte_offset()..];
                    }
                    // llguidance names what is wrong with it.
                    _ => rest = &rest["%json".len()..],
                }
            }
            '(' | '[' | '{' => {
                parens += 1;
                if parens > MAX_RULE_DEPTH {
                    return Err(too_deep_rules());
                }
                if let Some(b) = current.and_then(|n| rules.get_mut(n)) {
                    b.own = b.own.max(parens);
                }
                rest = &rest[step..];
            }
            ')' | ']' | '}' => {
                parens = parens.saturating_sub(1);
                rest = &rest[step..];
            }
            c if c.is_ascii_alphabetic() || c == '_' => {
                let end = rest.find(|c: char| !name_char(c)).unwrap_or(rest.len());
                if let Some(b) = current.and_then(|n| rules.get_mut(n)) {
                    b.refs.push((&rest[..end], parens));
                }
                rest = &rest[end..];
            }
            _ => rest = &rest[step..],
        }
    }
    Ok((order, rules))
}

/// `name:` (or `?name:`, `!?name:`, `name{params}:`, `!name.2:`, after blanks) at the start of
/// `s`: the name, and what follows the colon.
fn definition(s: &str) -> Option<(&str, &str)> {
    let s = s.trim_start_matches([' ', '\t']);
    let s = s.strip_prefix(['?', '!']).unwrap_or(s);
    let s = s.strip_prefix(['?', '!']).unwrap_or(s);
    if !s.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_') {
        return None;
    }
    let end = s.find(|c: char| !name_char(c))?;
    let (name, after) = s.split_at(end);
    // Template parameters: `name{a, b}:`.
    let after = match after.strip_prefix('{') {
        Some(p) => &p[p.find('}')? + 1..],
        None => after,
    };
    let after = match after.strip_prefix('.') {
        Some(p) => p.trim_start_matches(|c: char| c.is_ascii_digit() || c == '-'),
        None => after,
    };
    let after = after.trim_start_matches([' ', '\t']);
    after.strip_prefix(':').map(|a| (name, a))
}

/// The bytes of a literal opened by `q` at the start of `s`, its closing `q` (and a regex's
/// flags) included; all of `s` when it is not closed.
fn quoted_len(s: &str, q: char) -> usize {
    let mut escaped = false;
    for (i, c) in s.char_indices().skip(1) {
        if escaped {
            escaped = false;
        } else if c == '\\' {
            escaped = true;
        } else if c == q {
            let flags = s[i + 1..]
                .find(|c: char| !c.is_ascii_alphabetic())
                .unwrap_or(s.len() - i - 1);
            return if q == '/' { i + 1 + flags } else { i + 1 };
        } else if c == '\n' {
            return i;
        }
    }
    s.len()
}

fn skip_quoted(s: &str, q: char) -> &str {
    &s[quoted_len(s, q)..]
}

/// The deepest parenthesis in a regex, outside character classes and after escapes.
fn nesting_depth(rx: &str) -> usize {
    let (mut depth, mut deepest, mut escaped, mut class) = (0usize, 0usize, false, false);
    for c in rx.chars() {
        if escaped {
            escaped = false;
            continue;
        }
        match c {
            '\\' => escaped = true,
            '[' if !class => class = true,
            ']' if class => class = false,
            '(' if !class => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            ')' if !class => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    deepest
}

struct RuleWalk<'r, 'a> {
    rules: &'r HashMap<&'a str, Body<'a>>,
    /// Rules compiled or being compiled: a reference to one returns at once.
    entered: std::collections::HashSet<&'a str>,
}

impl<'a> RuleWalk<'_, 'a> {
    /// Enter rule `name` at `level`; `Err` past [`MAX_RULE_DEPTH`], which bounds this
    /// recursion too. Each rule is entered once, so the walk is linear in the grammar.
    fn depth(&mut self, name: &'a str, level: usize) -> Result<(), String> {
        let Some(body) = self.rules.get(name) else {
            // A keyword, or a name llguidance will call undefined.
            return Ok(());
        };
        if level + body.own > MAX_RULE_DEPTH {
            return Err(too_deep_rules());
        }
        self.entered.insert(name);
        for &(r, parens) in &body.refs {
            if self.rules.contains_key(r) && !self.entered.contains(r) {
                self.depth(r, level + 1 + parens)?;
            }
        }
        Ok(())
    }
}

/// A chain of `n` schemas, each a `$ref` to the next, the last a string (tests, the fuzz target).
pub fn ref_chain(n: usize) -> Value {
    let mut defs = Map::new();
    for i in 0..n {
        let next = if i + 1 == n {
            serde_json::json!({"type": "string"})
        } else {
            serde_json::json!({"$ref": format!("#/$defs/d{}", i + 1)})
        };
        defs.insert(format!("d{i}"), next);
    }
    serde_json::json!({"$defs": defs, "$ref": "#/$defs/d0"})
}

/// A Lark grammar of `n` rules, each the next's only use (tests, the fuzz target).
pub fn rule_chain(n: usize) -> String {
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn ref_chains_are_measured_and_refused_past_the_bound() {
        assert!(check(&Constraint::JsonSchema(ref_chain(20))).is_ok());
        let e = check(&Constraint::JsonSchema(ref_chain(300))).expect_err("too deep");
        assert!(e.contains("64 levels"), "{e}");
        // A recursive schema (a tree) is a reference back, not a chain.
        let tree = json!({"$defs": {"node": {"type": "object", "properties": {
            "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
            "$ref": "#/$defs/node"});
        assert!(check(&Constraint::JsonSchema(tree)).is_ok());
        // Each definition using the next twice: measured once each, not 2^60 times.
        let mut defs = Map::new();
        for i in 0..60 {
            defs.insert(
                format!("d{i}"),
                json!({"anyOf": [
                {"$ref": format!("#/$defs/d{}", i + 1)}, {"$ref": format!("#/$defs/d{}", i + 1)}]}),
            );
        }
        defs.insert("d60".into(), json!({"type": "string"}));
        let wide = json!({"$defs": defs, "$ref": "#/$defs/d0"});
        let e = check(&Constraint::JsonSchema(wide)).expect_err("120 levels");
        assert!(e.contains("deeper"), "{e}");
        // Anchors resolve; references elsewhere are refused by name.
        let anchored = json!({"$defs": {"a": {"$anchor": "a", "type": "string"}}, "$ref": "#a"});
        assert!(check(&Constraint::JsonSchema(anchored)).is_ok());
        let remote = json!({"$ref": "https://example.com/s.json"});
        let e = check(&Constraint::JsonSchema(remote)).expect_err("remote");
        assert!(e.contains("only references inside"), "{e}");
    }

    #[test]
    fn nested_schemas_count_each_level() {
        let mut s = json!({"type": "string"});
        for _ in 0..70 {
            s = json!({"type": "object", "properties": {"a": s}});
        }
        assert!(check(&Constraint::JsonSchema(s)).is_err());
        let mut s = json!({"type": "string"});
        for _ in 0..30 {
            s = json!({"anyOf": [{"type": "array", "items": s}, {"type": "null"}]});
        }
        // Two levels each (anyOf's branch, then items).
        assert!(check(&Constraint::JsonSchema(s)).is_ok());
    }

    #[test]
    fn lark_rule_chains_and_parentheses_are_bounded() {
        assert!(check(&Constraint::Lark(rule_chain(50))).is_ok());
        let e = check(&Constraint::Lark(rule_chain(1200))).expect_err("too deep");
        assert!(e.contains("128 levels"), "{e}");
        let parens = format!("start: {}\"x\"{}", "(".repeat(200), ")".repeat(200));
        assert!(check(&Constraint::Lark(parens)).is_err());
        // Recursion through a rule is fine; strings, regexes and comments are not rules.
        let g = "start: expr\nexpr: term (\"+\" term)*\n    | \"(\" expr \")\"\n?term: /[0-9]+/ // a (comment\nNUM.2: /(a(b))/\n";
        assert!(check(&Constraint::Lark(g.into())).is_ok());
        // A `%json` schema inside a grammar is measured as a schema.
        let g = format!("start: %json {}", ref_chain(100));
        let e = check(&Constraint::Lark(g)).expect_err("deep %json");
        assert!(e.contains("schema"), "{e}");
    }

    #[test]
    fn what_would_resolve_or_lex_otherwise_in_llguidance_is_refused_or_measured() {
        // An `$id` below the root moves the base `#/…` resolves against in llguidance.
        let mut inner = ref_chain(100);
        inner["$id"] = json!("http://x/s");
        let moved = json!({"$defs": {"d0": {"type": "string"}},
            "properties": {"p": inner}, "$ref": "#/$defs/d0"});
        let e = check(&Constraint::JsonSchema(moved)).expect_err("nested $id");
        assert!(e.contains("$id"), "{e}");
        // Percent-encoded pointers, anchors named twice, and too many references.
        let pct = json!({"$defs": {"c": {"type": "string"}}, "$ref": "#/$defs/%63"});
        assert!(check(&Constraint::JsonSchema(pct)).is_err());
        let twice = json!({"$defs": {"a": {"$anchor": "x"}, "b": {"$anchor": "x"}}, "$ref": "#x"});
        assert!(check(&Constraint::JsonSchema(twice)).is_err());
        let mut many = Map::new();
        for i in 0..=MAX_REFS {
            many.insert(format!("p{i}"), json!({"$ref": "#/$defs/s"}));
        }
        let wide = json!({"$defs": {"s": {"type": "string"}}, "properties": many});
        let e = check(&Constraint::JsonSchema(wide)).expect_err("too many refs");
        assert!(e.contains("$refs"), "{e}");
        // Names with hyphens, indented and doubly-prefixed definitions are rules.
        let mut g = String::from("start: r-0\n");
        for i in 0..1000 {
            g.push_str(&format!("r-{i}: r-{}\n", i + 1));
        }
        g.push_str("r-1000: \"x\"\n");
        assert!(check(&Constraint::Lark(g)).is_err(), "a hyphenated chain");
        let mut g = String::from("start: a0\n");
        for i in 0..200 {
            g.push_str(&format!("  !?a{i}: a{}\n", i + 1));
        }
        assert!(
            check(&Constraint::Lark(g)).is_err(),
            "indented, prefixed chain"
        );
        // A reference inside parentheses is as deep as they are.
        let mut g = String::from("start: a0\n");
        for i in 0..20 {
            g.push_str(&format!(
                "a{i}: {}a{}{}\n",
                "(".repeat(10),
                i + 1,
                ")".repeat(10)
            ));
        }
        assert!(check(&Constraint::Lark(g)).is_err(), "parentheses add up");
    }

    #[test]
    fn regexes_choices_and_sizes_are_bounded() {
        let rx = format!("{}a{}", "(".repeat(300), ")".repeat(300));
        assert!(check(&Constraint::Regex(rx)).is_err());
        assert!(check(&Constraint::Regex("[(]{3}(a|b)".into())).is_ok());
        let many: Vec<String> = (0..5000).map(|i| i.to_string()).collect();
        assert!(check(&Constraint::Choice(many)).is_err());
        assert!(check(&Constraint::Lark("x".repeat(MAX_CONSTRAINT_BYTES + 1))).is_err());
    }
}
