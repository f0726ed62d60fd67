//! What `dyn inspect` asks a `route` node, and the typed answers. The CLI reads the same
//! structs it is sent (`dyn inspect --json` prints them as they are), so a renamed field is a
//! compile error on both ends, not a silently empty column.
//!
//! Queries: [`Query`] — `workers`, `route` ([`RouteArgs`]) and `kv` ([`KvArgs`]) — built by the
//! CLI and the admin endpoint and matched by the nodes, so a query one side sends and the
//! other does not know is a compile error too. Worker ids are hex strings, as logs and
//! `/metrics` print them.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use dyn_core::Inspect;

use super::Inner;
use super::cost::{Candidate, Pricing};
use super::policy::{Policy, PromptRef};
use super::quality::QualityRow;

pub fn hex(id: u64) -> String {
    format!("{id:x}")
}

/// The admin endpoint's answer for one node: one entry per replica.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Replicas<T> {
    pub node: String,
    pub replicas: Vec<T>,
}

/// `workers`: the router's view of each worker.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WorkersAnswer {
    pub policy: Policy,
    pub target: String,
    pub workers: Vec<WorkerRow>,
    /// A `remote_prefill` node's decisions so far, by reason (absent for a `route` node).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decisions: Option<BTreeMap<String, u64>>,
    /// A `remote_prefill` node's queue (absent for a `route` node).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<String>,
    /// `kv`: how well the router used the caches so far.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quality: Option<QualityRow>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WorkerRow {
    pub worker_id: String,
    pub live: bool,
    pub active_requests: u32,
    pub pending_prefill_tokens: u64,
    pub active_blocks_routed: u64,
    /// Blocks the KV index holds for it (`kv` only).
    pub indexed_blocks: Option<usize>,
    /// From its last load metrics (none yet: `None`).
    pub requests_running: Option<u32>,
    pub requests_waiting: Option<u32>,
    pub kv_active_blocks: Option<u32>,
    pub kv_total_blocks: Option<u32>,
    pub prefix_cache_hit_rate: Option<f64>,
    /// Its circuit breaker: `closed`, `open` (left out of routing) or `half_open` (the next
    /// request is a probe).
    #[serde(default = "closed")]
    pub breaker: String,
    /// The wire KV blocks take to and from it (`inproc`, `tcp`, `ucx`), as it registered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transfer: Option<String>,
}

fn closed() -> String {
    "closed".into()
}

/// `route` arguments: the prompt's token ids, and (for a `remote_prefill` node) how many of
/// them the chosen decode worker caches.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RouteArgs {
    pub tokens: Vec<u32>,
    #[serde(default)]
    pub cached_tokens: usize,
    /// The request's session (`session_affinity`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    /// The request's LoRA adapter ([`dyn_protocol::types::LoraRef::key`]): its blocks are hashed
    /// under it, and workers that hold it are preferred, as for a real request of it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<String>,
}

/// `route`: where a prompt would go, and each candidate's terms (`kv`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RouteAnswer {
    pub policy: Policy,
    pub worker_id: String,
    pub prompt_tokens: usize,
    pub block_size: usize,
    pub prompt_blocks: usize,
    /// `kv`: the settings the costs come from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pricing: Option<Pricing>,
    /// `kv`: why the chosen worker won.
    #[serde(default)]
    pub reason: String,
    pub candidates: Vec<Candidate>,
    /// With a session: where it is bound, and whether the binding decides.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<SessionRow>,
}

/// A session's binding as `dyn inspect route --session` shows it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SessionRow {
    pub session: String,
    /// The worker it is bound to (none: unbound, or expired).
    pub bound_worker: Option<String>,
    pub expires_in_s: Option<f64>,
    /// The binding decides this request (its worker is live and under its bound).
    pub kept: bool,
    /// Sessions bound now, per worker.
    pub bound_per_worker: BTreeMap<String, usize>,
}

impl RouteAnswer {
    /// Prompt tokens the chosen worker caches.
    pub fn cached_tokens(&self) -> usize {
        self.candidates
            .iter()
            .find(|c| hex(c.worker) == self.worker_id)
            .map_or(0, |c| c.matched_blocks * self.block_size)
            .min(self.prompt_tokens)
    }
}

/// `kv` arguments: one worker only (hex id), and how many shared prefixes to list.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct KvArgs {
    #[serde(default)]
    pub worker: Option<String>,
    #[serde(default = "five")]
    pub top: usize,
}

fn five() -> usize {
    5
}

/// `kv`: the index's size and its most shared prefixes.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct KvAnswer {
    pub block_size: usize,
    pub tree_nodes: usize,
    pub stored_blocks: usize,
    pub bytes: usize,
    pub bytes_per_block: f64,
    pub workers: Vec<KvWorkerRow>,
    pub top_shared_prefixes: Vec<SharedPrefix>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct KvWorkerRow {
    pub worker_id: String,
    /// Distinct blocks held, in any tier.
    pub blocks: usize,
    /// Blocks per tier: the engine's pool (GPU), host memory (CPU), disk (DISK); a block
    /// in two tiers counts in both.
    #[serde(default)]
    pub gpu: usize,
    #[serde(default)]
    pub cpu: usize,
    #[serde(default)]
    pub disk: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SharedPrefix {
    pub blocks: usize,
    pub tokens: usize,
    pub hash: String,
    pub workers: Vec<String>,
}

/// A query to a `route` or `remote_prefill` node. Its name is the last segment of the admin
/// endpoint's path (`POST /admin/nodes/{node}/{name}`) and its arguments the JSON body; the
/// node reads it back with [`Query::parse`] (dyn-core's `Inspect` carries names and JSON, as it
/// knows no kind).
#[derive(Debug, Clone)]
pub enum Query {
    /// The router's view of each worker.
    Workers,
    /// Where a prompt would go.
    Route(RouteArgs),
    /// The KV index's size and most shared prefixes.
    Kv(KvArgs),
    /// The admission queue: room, waiting requests by priority, tenants' shares.
    Queue,
}

impl Query {
    pub const NAMES: &'static str = "workers, route, kv, queue";

    pub fn name(&self) -> &'static str {
        match self {
            Self::Workers => "workers",
            Self::Route(_) => "route",
            Self::Kv(_) => "kv",
            Self::Queue => "queue",
        }
    }

    /// The JSON body (`null` for a query without arguments).
    pub fn args(&self) -> Value {
        match self {
            Self::Workers | Self::Queue => Value::Null,
            Self::Route(a) => serde_json::to_value(a).unwrap_or_default(),
            Self::Kv(a) => serde_json::to_value(a).unwrap_or_default(),
        }
    }

    /// The admin endpoint's path for this query on `node`, below `/admin`.
    pub fn path(&self, node: &str) -> String {
        format!("/nodes/{node}/{}", self.name())
    }

    /// The query a node was sent, by name and JSON arguments.
    pub fn parse(name: &str, a: &Value) -> Result<Self, String> {
        Ok(match name {
            "workers" => Self::Workers,
            "route" => Self::Route(args(a)?),
            "kv" => Self::Kv(args(a)?),
            "queue" => Self::Queue,
            other => return Err(format!("unknown query {other:?}; known: {}", Self::NAMES)),
        })
    }
}

/// Parse a query's arguments (`null` reads as the defaults).
pub fn args<T: serde::de::DeserializeOwned + Default>(args: &Value) -> Result<T, String> {
    if args.is_null() {
        return Ok(T::default());
    }
    serde_json::from_value(args.clone()).map_err(|e| format!("bad arguments: {e}"))
}

impl Default for KvArgs {
    fn default() -> Self {
        Self {
            worker: None,
            top: five(),
        }
    }
}

fn to_value(v: impl Serialize) -> Result<Value, String> {
    serde_json::to_value(v).map_err(|e| e.to_string())
}

impl Inner {
    pub fn workers_answer(&self) -> WorkersAnswer {
        let now = std::time::Instant::now();
        let live = self.workers.live();
        let metrics = self.loads.reported.lock().clone();
        let index = self.placement.kv.as_ref().map(|kv| kv.index.read());
        let mut ids: Vec<u64> = live.clone();
        if let Some(ix) = &index {
            ids.extend(ix.worker_ids().filter(|w| !live.contains(w)));
        }
        ids.sort_unstable();
        let workers =
            ids.iter()
                .map(|&w| {
                    let load = self.loads.active.load(w);
                    let m = metrics.get(&w).map(|r| &r.metrics);
                    WorkerRow {
                        worker_id: hex(w),
                        live: live.contains(&w),
                        active_requests: load.requests,
                        pending_prefill_tokens: load.prefill_tokens,
                        active_blocks_routed: load.decode_blocks,
                        indexed_blocks: index.as_ref().map(|ix| ix.worker_blocks(w)),
                        requests_running: m.map(|m| m.requests_running),
                        requests_waiting: m.map(|m| m.requests_waiting),
                        kv_active_blocks: m.map(|m| m.kv_active_blocks),
                        kv_total_blocks: m.map(|m| m.kv_total_blocks),
                        prefix_cache_hit_rate: m.map(|m| m.prefix_cache_hit_rate),
                        breaker: self.avoidance.health.state(w, now).as_str().into(),
                        transfer: self.workers.instance(w).and_then(|i| {
                            Some(i.metadata.extra.get("transfer")?.as_str()?.to_owned())
                        }),
                    }
                })
                .collect();
        WorkersAnswer {
            policy: self.config.policy,
            target: self.workers.target.clone(),
            workers,
            decisions: None,
            queue: None,
            quality: self
                .placement
                .kv
                .is_some()
                .then(|| self.placement.quality.row()),
        }
    }

    pub fn route_answer(
        &self,
        tokens: &[u32],
        session: Option<&str>,
        lora: Option<&str>,
    ) -> Result<RouteAnswer, String> {
        let salt = dyn_protocol::kv::salt_of(None, lora);
        let memo = dyn_protocol::kv::PromptHashes::default();
        let mut d = self
            .decide_without(PromptRef::new(tokens, salt, &memo), lora, &|_| false)
            .map_err(|e| e.message)?;
        let now = std::time::Instant::now();
        let session = match (session, &self.sessions) {
            (Some(s), Some(sessions)) => {
                let kept = self.affinity(s, dyn_protocol::types::Precedence::default(), now);
                if let Some(w) = kept {
                    d.worker = w;
                }
                let binding = sessions.table.binding(s, now);
                let (_, per) = sessions.table.counts(now);
                Some(SessionRow {
                    session: s.to_owned(),
                    bound_worker: binding.map(|(w, _)| hex(w)),
                    expires_in_s: binding.map(|(_, left)| left),
                    kept: kept.is_some(),
                    bound_per_worker: per.into_iter().map(|(w, n)| (hex(w), n)).collect(),
                })
            }
            (Some(_), None) => {
                return Err("this router keeps no sessions (route.session_affinity)".into());
            }
            _ => None,
        };
        Ok(RouteAnswer {
            session,
            policy: self.config.policy,
            worker_id: hex(d.worker),
            prompt_tokens: tokens.len(),
            block_size: d.block_size,
            prompt_blocks: d.prompt_blocks,
            pricing: self.placement.kv.as_ref().map(|kv| kv.pricing.clone()),
            reason: d.reason(),
            candidates: d.candidates,
        })
    }

    pub fn kv_answer(&self, args: &KvArgs) -> Result<KvAnswer, String> {
        let Some(kv) = &self.placement.kv else {
            return Err(format!("policy {} keeps no KV index", self.config.policy));
        };
        let only = match &args.worker {
            Some(h) => Some(
                u64::from_str_radix(h, 16)
                    .map_err(|_| format!("worker {h:?} is not a hex worker id"))?,
            ),
            None => None,
        };
        let bs = kv.block_size();
        let ix = kv.index.read();
        let st = ix.stats();
        let mut ids: Vec<u64> = ix
            .worker_ids()
            .filter(|w| only.is_none_or(|o| o == *w))
            .collect();
        ids.sort_unstable();
        let workers = ids
            .iter()
            .map(|&w| {
                let [gpu, cpu, disk] = ix.worker_tier_blocks(w);
                KvWorkerRow {
                    worker_id: hex(w),
                    blocks: ix.worker_blocks(w),
                    gpu,
                    cpu,
                    disk,
                }
            })
            .collect();
        let top_shared_prefixes = ix
            .top_prefixes(args.top)
            .into_iter()
            .filter(|(_, _, ws)| only.is_none_or(|o| ws.contains(&o)))
            .map(|(depth, hash, ws)| SharedPrefix {
                blocks: depth,
                tokens: depth * bs,
                hash: hex(hash),
                workers: ws.into_iter().map(hex).collect(),
            })
            .collect();
        Ok(KvAnswer {
            block_size: bs,
            tree_nodes: st.nodes,
            stored_blocks: st.worker_blocks,
            bytes: st.bytes,
            bytes_per_block: if st.worker_blocks > 0 {
                st.bytes as f64 / st.worker_blocks as f64
            } else {
                0.0
            },
            workers,
            top_shared_prefixes,
        })
    }
}

/// What a node without an admission queue answers `dyn inspect queue` with (the CLI passes
/// such nodes over by it).
pub const NO_QUEUE: &str = "no admission queue";

impl Inspect for Inner {
    fn inspect(&self, query: &str, a: &Value) -> Result<Value, String> {
        match Query::parse(query, a)? {
            Query::Workers => to_value(self.workers_answer()),
            Query::Route(a) => {
                to_value(self.route_answer(&a.tokens, a.session.as_deref(), a.lora.as_deref())?)
            }
            Query::Kv(a) => to_value(self.kv_answer(&a)?),
            Query::Queue => match &self.admission {
                Some(a) => to_value(a.answer()),
                None => Err(format!("this router has {NO_QUEUE} (route.admission)")),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_query_reads_back_as_it_was_sent() {
        let sent = [
            Query::Workers,
            Query::Route(RouteArgs {
                tokens: vec![1, 2, 3],
                cached_tokens: 2,
                session: Some("conv".into()),
                lora: Some("qv\0abc".into()),
            }),
            Query::Queue,
            Query::Kv(KvArgs {
                worker: Some("bee".into()),
                top: 3,
            }),
        ];
        for q in sent {
            let got = Query::parse(q.name(), &q.args()).unwrap();
            assert_eq!(format!("{got:?}"), format!("{q:?}"));
        }
        assert!(matches!(
            Query::parse("kv", &Value::Null),
            Ok(Query::Kv(KvArgs { top: 5, .. }))
        ));
        let e = Query::parse("nodes", &Value::Null).unwrap_err();
        assert!(e.contains("known: workers, route, kv"), "{e}");
        assert_eq!(Query::Workers.path("route"), "/nodes/route/workers");
    }
}
