//! `echo`: answers each text with itself, optionally in pieces and slowly.
//!
//! A real kind, meant for debugging graphs and the runtime: `split: words` with `delay_ms`
//! turns one request into a slow stream, which is how the tests exercise streaming, client
//! cancellation and graceful drain without an engine.
//!
//! ```yaml
//! echo: {kind: echo, inputs: [ingress], config: {split: words, delay_ms: 20}}
//! ```

use std::time::Duration;

use dyn_core::registry::Role;
use dyn_core::{BuildCx, BuildError, Ctx, Input, Invalid, Operator, OperatorConfig, Output};
use futures::StreamExt;
use serde::Deserialize;

use dyn_protocol::text::Text;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Split {
    /// The whole text as one item.
    #[default]
    Whole,
    /// One item per word, each keeping its trailing whitespace.
    Words,
    /// One item per character.
    Chars,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EchoConfig {
    #[serde(default)]
    pub split: Split,
    /// Pause before each piece, to simulate a slow producer.
    #[serde(default)]
    pub delay_ms: u64,
    /// Text put before the first piece.
    #[serde(default)]
    pub prefix: String,
}

const MAX_DELAY_MS: u64 = 60_000;

impl OperatorConfig for EchoConfig {
    const KIND: &'static str = "echo";
    const SUMMARY: &'static str = "Echoes its input, optionally word by word with a delay";
    const ROLE: Role = Role::Worker;
    type Op = Echo;

    fn validate(&self) -> Vec<Invalid> {
        let mut out = Vec::new();
        if self.delay_ms > MAX_DELAY_MS {
            out.push(Invalid::field(
                "delay_ms",
                format!(
                    "{} is more than the maximum of {MAX_DELAY_MS}",
                    self.delay_ms
                ),
            ));
        }
        out
    }

    async fn build(&self, cx: &BuildCx) -> Result<Echo, BuildError> {
        Ok(Echo {
            config: self.clone(),
            node: cx.node.clone(),
        })
    }
}

pub struct Echo {
    config: EchoConfig,
    node: String,
}

fn pieces(text: &str, split: Split) -> Vec<String> {
    match split {
        Split::Whole => vec![text.to_owned()],
        Split::Words => text
            .split_inclusive(char::is_whitespace)
            .map(str::to_owned)
            .collect(),
        Split::Chars => text.chars().map(String::from).collect(),
    }
}

impl Operator for Echo {
    type In = Text;
    type Out = Text;

    fn call(&self, ctx: Ctx, mut input: Input<Text>) -> Output<Text> {
        let config = self.config.clone();
        let node = self.node.clone();
        async_stream::stream! {
            let mut first = true;
            while let Some(Text(text)) = input.next().await {
                let mut parts = pieces(&text, config.split);
                if first && !config.prefix.is_empty() {
                    parts.insert(0, config.prefix.clone());
                }
                first = false;
                for part in parts {
                    if config.delay_ms > 0 {
                        tokio::select! {
                            _ = tokio::time::sleep(Duration::from_millis(config.delay_ms)) => {}
                            _ = ctx.killed() => {
                                tracing::debug!(node = %node, request_id = %ctx.id(), "Echo killed");
                                return;
                            }
                        }
                    }
                    if ctx.is_killed() {
                        return;
                    }
                    yield Ok(Text(part));
                }
            }
        }
        .boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitting_keeps_every_character() {
        let text = "héllo  wörld\n!";
        for split in [Split::Whole, Split::Words, Split::Chars] {
            assert_eq!(pieces(text, split).concat(), text);
        }
        assert_eq!(pieces("a b", Split::Words), vec!["a ", "b"]);
    }
}
