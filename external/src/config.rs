//! The YAML section of an external engine (`vllm:`, `llamacpp:`, `openai:` on `decode`): where
//! each replica's server is, or how dyn starts one, and how dyn watches it.

use std::collections::BTreeMap;

use dyn_core::Invalid;
use serde::Deserialize;

/// Which server protocol a replica speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExternalKind {
    /// vLLM's OpenAI server: `/v1/completions` with token ids in and out, KV events over
    /// ZeroMQ, Prometheus load.
    Vllm,
    /// llama.cpp's `llama-server`: native `/completion` with token ids in and out.
    Llamacpp,
    /// Any OpenAI-compatible server: text in and out (dyn's tokenizer on both sides).
    Openai,
}

impl ExternalKind {
    pub fn name(self) -> &'static str {
        match self {
            ExternalKind::Vllm => "vllm",
            ExternalKind::Llamacpp => "llamacpp",
            ExternalKind::Openai => "openai",
        }
    }
}

/// Where one vLLM server's KV events come from: `events`, the endpoint its publisher binds
/// (its `--kv-events-config` `endpoint: tcp://*:PORT`), which dyn connects to; or `listen`, a
/// loopback endpoint dyn binds and the server's publisher connects to (its `endpoint` names
/// it). `replay`: its `replay_endpoint`.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct KvPublisher {
    pub events: Option<String>,
    pub listen: Option<String>,
    pub replay: Option<String>,
}

/// The longest interval or timeout a section may give: a year.
const MAX_SECONDS: f64 = 365.0 * 24.0 * 3600.0;

/// An external engine's section. Exactly one of `url`, `urls` and `launch` says where the
/// replicas' servers are:
///
/// ```yaml
/// vllm: {urls: [http://10.0.0.1:8000, http://10.0.0.2:8000]}   # two replicas, already running
/// vllm:                                                        # dyn starts one per replica
///   launch: python -m vllm.entrypoints.openai.api_server --model {model} --port {port}
///   kv_events: true
/// ```
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ExternalConfig {
    /// One running server (one replica).
    pub url: Option<String>,
    /// Running servers, one replica each.
    pub urls: Vec<String>,
    /// A shell command that starts one server per replica, with placeholders: `{port}` (a free
    /// loopback port, new at each start), `{host}` (127.0.0.1), `{model}` (the graph's model
    /// path), `{model_name}`, `{replica}`. dyn supervises it: waits for its health, restarts
    /// it when it exits or stops answering, and stops it (its whole process group) on shutdown.
    pub launch: Option<String>,
    /// Environment for the launched command.
    pub env: BTreeMap<String, String>,
    /// The model name the server serves; by default the first its `/v1/models` lists.
    pub served_model: Option<String>,
    /// Seconds a launched server may take to become healthy before it is restarted.
    pub startup_timeout_s: f64,
    /// Seconds between health checks of a ready server.
    pub health_interval_s: f64,
    /// Seconds a request may wait for the server's next byte (its response, then each streamed
    /// event) before the replica counts as lost and the request migrates: what catches a
    /// server that still answers its health check but no longer its streams.
    pub stall_timeout_s: f64,
    /// Seconds between scrapes of the server's Prometheus metrics (its load); 0 turns it off.
    pub metrics_interval_s: f64,
    /// vLLM with `launch`: subscribe to its KV events (dyn adds `--kv-events-config`).
    pub kv_events: bool,
    /// vLLM with `url`/`urls`: where each server publishes KV events, one per server.
    pub kv_publishers: Vec<KvPublisher>,
    /// Tokens per KV block announced for a server that does not say its own (llama.cpp): what
    /// an approximate router hashes prompts with; by default the router's own choice.
    pub block_size: Option<u32>,
    /// vLLM: the servers serve the graph's LoRA adapters, which dyn loads into each at run
    /// time through vLLM's own `/v1/load_lora_adapter` (with `launch`, dyn adds
    /// `--enable-lora` and these limits, and allows run-time loading in its environment).
    pub lora: Option<LoraServing>,
}

/// The `--max-lora-rank` values vLLM accepts.
const VLLM_LORA_RANKS: [u32; 9] = [1, 8, 16, 32, 64, 128, 256, 320, 512];

/// vLLM's LoRA settings (see [`ExternalConfig::lora`]).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct LoraServing {
    /// `--max-lora-rank`: the largest rank it takes (vLLM accepts 1, 8, 16, 32, 64, 128, 256,
    /// 320, 512).
    pub max_rank: u32,
    /// `--max-loras`: adapters in one batch.
    pub max_loras: u32,
    /// Adapters dyn keeps loaded per server, the least recently used unloaded past it.
    pub keep: usize,
}

impl Default for LoraServing {
    fn default() -> Self {
        Self {
            max_rank: 16,
            max_loras: 4,
            keep: 32,
        }
    }
}

impl LoraServing {
    /// What dyn adds to a launched vLLM's command line.
    pub fn launch_args(&self) -> String {
        format!(
            "--enable-lora --max-lora-rank {} --max-loras {}",
            self.max_rank, self.max_loras
        )
    }
}

impl Default for ExternalConfig {
    fn default() -> Self {
        Self {
            url: None,
            urls: Vec::new(),
            launch: None,
            env: BTreeMap::new(),
            served_model: None,
            // vLLM compiles its model at start: minutes on a small CPU.
            startup_timeout_s: 600.0,
            health_interval_s: 2.0,
            // A queued request of a loaded server waits well within this.
            stall_timeout_s: 300.0,
            metrics_interval_s: 0.5,
            kv_events: false,
            kv_publishers: Vec::new(),
            block_size: None,
            lora: None,
        }
    }
}

impl ExternalConfig {
    /// The servers given by URL, in replica order (empty with `launch`).
    pub fn urls(&self) -> &[String] {
        match &self.url {
            Some(u) => std::slice::from_ref(u),
            None => &self.urls,
        }
    }

    /// Replicas the config fixes: one per URL.
    pub fn replicas(&self) -> Option<u32> {
        if self.launch.is_some() {
            return None;
        }
        u32::try_from(self.urls().len()).ok().filter(|n| *n > 0)
    }

    /// Whether this replica's server publishes KV events dyn follows.
    pub fn follows_kv_events(&self, kind: ExternalKind) -> bool {
        kind == ExternalKind::Vllm && (self.kv_events || !self.kv_publishers.is_empty())
    }

    pub fn validate(&self, kind: ExternalKind, prefix: &str) -> Vec<Invalid> {
        let mut out = Vec::new();
        self.validate_servers(prefix, &mut out);
        self.validate_launch(prefix, &mut out);
        self.validate_numbers(prefix, &mut out);
        if let Some(l) = &self.lora {
            if kind != ExternalKind::Vllm {
                out.push(Invalid::field(
                    format!("{prefix}lora"),
                    format!(
                        "only vLLM servers load adapters at run time ({} does not: its adapters are fixed when it starts)",
                        kind.name()
                    ),
                ));
            }
            if l.max_loras == 0 || l.keep == 0 {
                out.push(Invalid::field(
                    format!("{prefix}lora"),
                    "max_loras and keep must be at least 1",
                ));
            }
            if !VLLM_LORA_RANKS.contains(&l.max_rank) {
                out.push(Invalid::field(
                    format!("{prefix}lora.max_rank"),
                    format!("vLLM takes one of {VLLM_LORA_RANKS:?}"),
                ));
            }
        }
        if kind != ExternalKind::Vllm {
            self.validate_no_kv_events(kind, prefix, &mut out);
        } else {
            self.validate_kv_events(prefix, &mut out);
        }
        out
    }

    /// Exactly one of `url`, `urls` and `launch`, and the URLs' form.
    fn validate_servers(&self, prefix: &str, out: &mut Vec<Invalid>) {
        let given = [
            self.url.is_some(),
            !self.urls.is_empty(),
            self.launch.is_some(),
        ];
        match given.iter().filter(|g| **g).count() {
            0 => out.push(Invalid::general(format!(
                "{prefix}: give the servers: `url`, `urls` (one per replica) or `launch` (a command dyn runs per replica)"
            ))),
            1 => {}
            _ => out.push(Invalid::general(format!(
                "{prefix}: give only one of `url`, `urls` and `launch`"
            ))),
        }
        for (i, u) in self.urls().iter().enumerate() {
            let field = if self.url.is_some() {
                format!("{prefix}url")
            } else {
                format!("{prefix}urls[{i}]")
            };
            match reqwest::Url::parse(u) {
                Ok(p) if matches!(p.scheme(), "http" | "https") && p.host().is_some() => {}
                Ok(_) => out.push(Invalid::field(
                    field,
                    format!("`{u}` is not an http(s) URL"),
                )),
                Err(e) => out.push(Invalid::field(field, format!("`{u}`: {e}"))),
            }
        }
    }

    /// The launch command's placeholders; `env` only with it.
    fn validate_launch(&self, prefix: &str, out: &mut Vec<Invalid>) {
        let f = |name: &str| format!("{prefix}{name}");
        if let Some(cmd) = &self.launch {
            if !cmd.contains("{port}") {
                out.push(Invalid::field(
                    f("launch"),
                    "must contain `{port}`: each replica's server listens on its own port",
                ));
            }
            if let Some(bad) = unknown_placeholder(cmd) {
                out.push(Invalid::field(
                    f("launch"),
                    format!("unknown placeholder `{{{bad}}}`; known: {{port}}, {{host}}, {{model}}, {{model_name}}, {{replica}}"),
                ));
            }
        } else if !self.env.is_empty() {
            out.push(Invalid::field(f("env"), "only used with `launch`"));
        }
    }

    /// The intervals and the block size.
    fn validate_numbers(&self, prefix: &str, out: &mut Vec<Invalid>) {
        let f = |name: &str| format!("{prefix}{name}");
        for (name, v) in [
            ("startup_timeout_s", self.startup_timeout_s),
            ("health_interval_s", self.health_interval_s),
            ("stall_timeout_s", self.stall_timeout_s),
        ] {
            // Bounded: a number of seconds past a Duration's range would panic the worker.
            if !(v.is_finite() && v > 0.0 && v <= MAX_SECONDS) {
                out.push(Invalid::field(
                    f(name),
                    format!("must be a positive number of seconds, at most {MAX_SECONDS}"),
                ));
            }
        }
        if !(self.metrics_interval_s.is_finite()
            && (0.0..=MAX_SECONDS).contains(&self.metrics_interval_s))
        {
            out.push(Invalid::field(
                f("metrics_interval_s"),
                "must be 0 (off) or a positive number",
            ));
        }
        if self.block_size == Some(0) {
            out.push(Invalid::field(f("block_size"), "must be at least 1"));
        }
    }

    /// A server other than vLLM: no KV events to follow.
    fn validate_no_kv_events(&self, kind: ExternalKind, prefix: &str, out: &mut Vec<Invalid>) {
        if self.kv_events {
            out.push(Invalid::field(
                format!("{prefix}kv_events"),
                format!(
                    "{} servers publish no KV events; route with `kv_events: false` (approximate)",
                    kind.name()
                ),
            ));
        }
        if !self.kv_publishers.is_empty() {
            out.push(Invalid::field(
                format!("{prefix}kv_publishers"),
                format!("{} servers publish no KV events", kind.name()),
            ));
        }
    }

    /// vLLM: `kv_events` with `launch`, or one `kv_publishers` entry per server given by URL.
    fn validate_kv_events(&self, prefix: &str, out: &mut Vec<Invalid>) {
        let f = |name: &str| format!("{prefix}{name}");
        if self.kv_events && self.launch.is_none() {
            out.push(Invalid::field(
                f("kv_events"),
                "only with `launch`; for servers given by URL list where each publishes in `kv_publishers`",
            ));
        }
        if self.kv_publishers.is_empty() {
            return;
        }
        let n = self.urls().len();
        if self.launch.is_some() {
            out.push(Invalid::field(
                f("kv_publishers"),
                "only with `url`/`urls`; with `launch` say `kv_events: true`",
            ));
        } else if self.kv_publishers.len() != n {
            out.push(Invalid::field(
                f("kv_publishers"),
                format!(
                    "{} given for {n} servers: one per server, in the same order",
                    self.kv_publishers.len()
                ),
            ));
        }
        for (i, p) in self.kv_publishers.iter().enumerate() {
            p.validate(&format!("{prefix}kv_publishers[{i}]"), out);
        }
    }
}

impl KvPublisher {
    /// One of `events` and `listen`, and ZeroMQ TCP endpoints; `field` names this entry.
    fn validate(&self, field: &str, out: &mut Vec<Invalid>) {
        if self.events.is_some() == self.listen.is_some() {
            out.push(Invalid::field(
                field,
                "give `events` (the server binds, dyn connects) or `listen` (dyn binds, the server connects)",
            ));
        }
        for (what, e) in [
            ("events", self.events.as_ref()),
            ("listen", self.listen.as_ref()),
            ("replay", self.replay.as_ref()),
        ] {
            if let Some(e) = e
                && !e.starts_with("tcp://")
            {
                out.push(Invalid::field(
                    format!("{field}.{what}"),
                    format!("`{e}` is not a tcp:// ZeroMQ endpoint"),
                ));
            }
        }
    }
}

/// The first `{name}` in `cmd` that is not a placeholder dyn fills.
fn unknown_placeholder(cmd: &str) -> Option<String> {
    const KNOWN: [&str; 5] = ["port", "host", "model", "model_name", "replica"];
    let mut rest = cmd;
    while let Some(start) = rest.find('{') {
        let after = &rest[start + 1..];
        let end = after.find('}')?;
        let name = &after[..end];
        // JSON in a command (`--kv-events-config '{"a": 1}'`) is not a placeholder, nor is a
        // shell variable (`${HOME}`).
        let shell = start > 0 && rest.as_bytes()[start - 1] == b'$';
        if !shell
            && !name.is_empty()
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            && !KNOWN.contains(&name)
        {
            return Some(name.to_owned());
        }
        rest = &after[end + 1..];
    }
    None
}

/// `cmd` with its placeholders filled.
pub fn fill(cmd: &str, values: &[(&str, &str)]) -> String {
    let mut out = cmd.to_owned();
    for (k, v) in values {
        out = out.replace(&format!("{{{k}}}"), v);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(yaml: &str) -> ExternalConfig {
        let node = marked_yaml::parse_yaml(0, yaml).expect("yaml");
        marked_yaml::from_node(&node).expect("config")
    }

    fn problems(kind: ExternalKind, yaml: &str) -> Vec<String> {
        parse(yaml)
            .validate(kind, "vllm.")
            .into_iter()
            .map(|i| format!("{}: {}", i.field.unwrap_or_default(), i.message))
            .collect()
    }

    #[test]
    fn two_running_servers_take_one_line_and_fix_the_replica_count() {
        let c = parse("urls: [http://10.0.0.1:8000, http://10.0.0.2:8000]");
        assert!(c.validate(ExternalKind::Vllm, "vllm.").is_empty());
        assert_eq!(c.replicas(), Some(2));
        assert_eq!(parse("url: http://h:1").replicas(), Some(1));
        let l = parse("launch: serve --port {port}");
        assert_eq!(l.replicas(), None);
        assert!(!l.follows_kv_events(ExternalKind::Vllm));
    }

    #[test]
    fn bad_sections_are_named() {
        let p = problems(ExternalKind::Vllm, "health_interval_s: 1");
        assert!(p[0].contains("give the servers"), "{p:?}");
        let p = problems(ExternalKind::Vllm, "url: http://h:1\nlaunch: x {port}");
        assert!(p[0].contains("only one of"), "{p:?}");
        let p = problems(ExternalKind::Vllm, "urls: [ftp://h, 'http://']");
        assert!(p[0].starts_with("vllm.urls[0]: `ftp://h` is not"), "{p:?}");
        assert!(p[1].starts_with("vllm.urls[1]"), "{p:?}");
        let p = problems(ExternalKind::Vllm, "launch: serve --port 8000");
        assert!(p[0].contains("must contain `{port}`"), "{p:?}");
        let p = problems(ExternalKind::Vllm, "launch: serve --port {port} --x {prot}");
        assert!(p[0].contains("unknown placeholder `{prot}`"), "{p:?}");
        let p = problems(ExternalKind::Llamacpp, "url: http://h:1\nkv_events: true");
        assert!(
            p[0].starts_with("vllm.kv_events: llamacpp servers"),
            "{p:?}"
        );
        let p = problems(
            ExternalKind::Vllm,
            "urls: [http://a:1, http://b:1]\nkv_publishers: [{events: 'tcp://a:5557'}]",
        );
        assert!(p[0].contains("1 given for 2 servers"), "{p:?}");
        let p = problems(
            ExternalKind::Vllm,
            "url: http://a:1\nkv_publishers: [{events: 'tcp://a:5557', listen: 'tcp://127.0.0.1:1'}]",
        );
        assert!(p[0].contains("give `events`"), "{p:?}");
        let p = problems(ExternalKind::Vllm, "url: http://a:1\nkv_events: true");
        assert!(p[0].contains("only with `launch`"), "{p:?}");
        // Seconds past a Duration's range are refused, not a panic at run time.
        let p = problems(
            ExternalKind::Vllm,
            "url: http://a:1\nstall_timeout_s: 1e300\nhealth_interval_s: 0\nmetrics_interval_s: 1e30",
        );
        assert_eq!(p.len(), 3, "{p:?}");
        assert!(
            p[0].starts_with("vllm.health_interval_s: must be a positive"),
            "{p:?}"
        );
        assert!(
            p[1].starts_with("vllm.stall_timeout_s: must be a positive"),
            "{p:?}"
        );
    }

    #[test]
    fn json_in_a_command_is_not_a_placeholder() {
        let cmd = r#"serve --port {port} --kv '{"a": 1}' {model}"#;
        assert_eq!(unknown_placeholder(cmd), None);
        assert_eq!(unknown_placeholder("${HOME}/serve {port}"), None);
        assert_eq!(
            fill(cmd, &[("port", "9"), ("model", "/m")]),
            r#"serve --port 9 --kv '{"a": 1}' /m"#
        );
    }
}
