//! Diagnostics: every configuration problem with the place in the YAML that caused it.
//!
//! The rendering `FILE:LINE:COL: node 'ID': message` is part of the interface (editors and CI
//! logs jump to it) and is snapshot-tested.

use std::fmt;

/// A 1-based line and column in one of the loaded sources.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
pub struct Pos {
    /// Which source: 0 is the graph file, `n > 0` is the n-th `--set` override.
    pub source: usize,
    pub line: usize,
    pub col: usize,
}

impl Pos {
    pub(crate) fn of_span(span: &marked_yaml::Span) -> Option<Pos> {
        span.start().map(Self::of_marker)
    }

    pub(crate) fn of_marker(m: &marked_yaml::Marker) -> Pos {
        Pos {
            source: m.source(),
            line: m.line(),
            col: m.column(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Severity {
    Error,
    Warning,
}

/// One problem found in a graph.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Diagnostic {
    pub severity: Severity,
    pub pos: Option<Pos>,
    pub node: Option<String>,
    pub message: String,
}

impl Diagnostic {
    pub fn error(pos: Option<Pos>, node: Option<&str>, message: impl Into<String>) -> Self {
        Self {
            severity: Severity::Error,
            pos,
            node: node.map(str::to_owned),
            message: message.into(),
        }
    }

    pub fn warning(pos: Option<Pos>, node: Option<&str>, message: impl Into<String>) -> Self {
        Self {
            severity: Severity::Warning,
            ..Self::error(pos, node, message)
        }
    }
}

/// All diagnostics of one graph, with the names of its sources for rendering.
#[derive(Debug, Clone, Default)]
pub struct Diagnostics {
    /// `sources[0]` is the graph file's path; later entries name `--set` overrides.
    pub sources: Vec<String>,
    pub items: Vec<Diagnostic>,
}

impl Diagnostics {
    pub fn new(file: impl Into<String>) -> Self {
        Self {
            sources: vec![file.into()],
            items: Vec::new(),
        }
    }

    pub fn push(&mut self, d: Diagnostic) {
        self.items.push(d);
    }

    pub fn has_errors(&self) -> bool {
        self.items.iter().any(|d| d.severity == Severity::Error)
    }

    pub fn errors(&self) -> impl Iterator<Item = &Diagnostic> {
        self.items.iter().filter(|d| d.severity == Severity::Error)
    }

    pub fn warnings(&self) -> impl Iterator<Item = &Diagnostic> {
        self.items
            .iter()
            .filter(|d| d.severity == Severity::Warning)
    }

    /// Sorted by position so output reads top to bottom like the file.
    pub fn sort(&mut self) {
        self.items.sort_by(|a, b| {
            (a.pos.is_none(), a.pos, a.severity).cmp(&(b.pos.is_none(), b.pos, b.severity))
        });
    }

    /// Render one diagnostic as `FILE:LINE:COL: node 'ID': message`.
    pub fn render(&self, d: &Diagnostic) -> String {
        let mut out = String::new();
        match d.pos {
            Some(p) => {
                let src = self
                    .sources
                    .get(p.source)
                    .map(String::as_str)
                    .unwrap_or("<unknown>");
                out.push_str(&format!("{src}:{}:{}: ", p.line, p.col));
            }
            None => {
                let src = self
                    .sources
                    .first()
                    .map(String::as_str)
                    .unwrap_or("<graph>");
                out.push_str(&format!("{src}: "));
            }
        }
        if d.severity == Severity::Warning {
            out.push_str("warning: ");
        }
        if let Some(node) = &d.node {
            out.push_str(&format!("node '{node}': "));
        }
        out.push_str(&d.message);
        out
    }
}

impl fmt::Display for Diagnostics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for d in &self.items {
            writeln!(f, "{}", self.render(d))?;
        }
        Ok(())
    }
}

impl std::error::Error for Diagnostics {}
