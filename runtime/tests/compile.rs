//! Compiler tests: one per error class, on small kinds defined here, with snapshots of the
//! rendered diagnostics (their text and `FILE:LINE:COL` are part of the interface).
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is a failure report

use dyn_core::registry::{Invalid, Role};
use dyn_core::{
    BuildCx, BuildError, Chain, Codec, Ctx, Ingress, IngressConfig, Input, OpError, Operator,
    OperatorConfig, Output, Payload, Registry, ShutdownSignal,
};
use dyn_runtime::spec::{Override, load_str};
use dyn_runtime::{Diagnostics, Plan, compile};
use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use serde::{Deserialize, Serialize};

macro_rules! payload {
    ($t:ident, wire) => {
        #[derive(Serialize, Deserialize)]
        struct $t;
        impl Payload for $t {
            const NAME: &'static str = stringify!($t);
            fn codec() -> Option<Codec> {
                Some(Codec::json::<Self>())
            }
        }
    };
    ($t:ident, local) => {
        struct $t;
        impl Payload for $t {
            const NAME: &'static str = stringify!($t);
        }
    };
}
payload!(A, wire);
payload!(B, wire);
payload!(L, local);

/// Operator kinds `A → B`, `B → B`, `A → L`, `L → B`, and `B → B` as each role, all with an
/// optional bounded `factor`.
macro_rules! op_kind {
    ($cfg:ident, $op:ident, $name:literal, $in:ty, $out:ty) => {
        op_kind!($cfg, $op, $name, $in, $out, Stage);
    };
    ($cfg:ident, $op:ident, $name:literal, $in:ty, $out:ty, $role:ident) => {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct $cfg {
            #[serde(default)]
            factor: u32,
        }
        struct $op;
        impl Operator for $op {
            type In = $in;
            type Out = $out;
            fn call(&self, _ctx: Ctx, _input: Input<$in>) -> Output<$out> {
                futures::stream::empty().boxed()
            }
        }
        impl OperatorConfig for $cfg {
            const KIND: &'static str = $name;
            const SUMMARY: &'static str = "test kind";
            const ROLE: Role = Role::$role;
            type Op = $op;
            fn validate(&self) -> Vec<Invalid> {
                if self.factor > 10 {
                    vec![Invalid::field("factor", "must be at most 10")]
                } else {
                    vec![]
                }
            }
            async fn build(&self, _cx: &BuildCx) -> Result<$op, BuildError> {
                Ok($op)
            }
        }
    };
}
op_kind!(A2BConfig, A2B, "a2b", A, B);
op_kind!(B2BConfig, B2B, "b2b", B, B);
op_kind!(A2LConfig, A2L, "a2l", A, L);
op_kind!(L2BConfig, L2B, "l2b", L, B);
op_kind!(RouterConfig, Router, "router", B, B, Router);
op_kind!(ViaConfig, Via, "via", B, B, PassThrough);
op_kind!(WorkerConfig, Worker, "worker", B, B, Worker);
op_kind!(BentConfig, Bent, "bent_router", A, B, Router);

/// A worker kind whose config lists its servers, one replica each.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ServersConfig {
    servers: Vec<String>,
}
impl OperatorConfig for ServersConfig {
    const KIND: &'static str = "servers";
    const SUMMARY: &'static str = "test kind";
    const ROLE: Role = Role::Worker;
    type Op = Worker;
    fn replicas(&self) -> Option<u32> {
        u32::try_from(self.servers.len()).ok()
    }
    async fn build(&self, _cx: &BuildCx) -> Result<Worker, BuildError> {
        Ok(Worker)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SrcConfig {
    #[serde(default)]
    #[allow(dead_code)]
    port: u16,
}
struct Src;
impl Ingress for Src {
    type Request = A;
    type Response = B;
    fn serve(
        self: Box<Self>,
        _chain: Chain<A, B>,
        _shutdown: ShutdownSignal,
    ) -> BoxFuture<'static, Result<(), OpError>> {
        async { Ok(()) }.boxed()
    }
}
impl IngressConfig for SrcConfig {
    const KIND: &'static str = "src";
    const SUMMARY: &'static str = "test ingress";
    type Ingress = Src;
    async fn build(&self, _cx: &BuildCx) -> Result<Src, BuildError> {
        Ok(Src)
    }
}

fn registry() -> Registry {
    Registry::new()
        .ingress::<SrcConfig>()
        .operator::<A2BConfig>()
        .operator::<B2BConfig>()
        .operator::<A2LConfig>()
        .operator::<L2BConfig>()
        .operator::<RouterConfig>()
        .operator::<ViaConfig>()
        .operator::<WorkerConfig>()
        .operator::<BentConfig>()
        .operator::<ServersConfig>()
}

fn check_with(
    yaml: &str,
    overrides: &[Override],
) -> Result<dyn_runtime::CompiledGraph, Diagnostics> {
    let (spec, diags) = load_str("g.yaml", yaml, overrides)?;
    compile(&spec, diags, ".".into(), &registry())
}

/// Compile and return the rendered errors (panics if the graph is valid).
fn errors(yaml: &str) -> String {
    match check_with(yaml, &[]) {
        Ok(_) => panic!("graph unexpectedly valid:\n{yaml}"),
        Err(d) => d.to_string(),
    }
}

const HEADER: &str = "name: t\nnodes:\n";

#[test]
fn valid_graph_compiles_with_its_path() {
    let g = check_with(
        &format!("{HEADER}  in: {{kind: src}}\n  x: {{kind: a2b, inputs: [in], replicas: 2}}\n  y: {{kind: b2b, inputs: [x], process: x, replicas: 2}}\n"),
        &[],
    )
    .unwrap();
    assert_eq!(g.chains.len(), 1);
    let path: Vec<&str> = g.chains[0]
        .path
        .iter()
        .map(|&i| g.nodes[i].id.as_str())
        .collect();
    assert_eq!(path, ["x", "y"]);
    let plan = Plan::new(&g);
    assert_eq!(plan.processes.len(), 2);
    assert!(
        plan.edges
            .iter()
            .any(|e| e.from == "in" && e.crosses_process)
    );
    assert!(
        plan.edges
            .iter()
            .any(|e| e.from == "x" && !e.crosses_process)
    );
}

#[test]
fn a_config_that_lists_servers_fixes_the_replica_count() {
    let yaml = |replicas: &str| {
        format!(
            "{HEADER}  in: {{kind: src}}\n  x: {{kind: a2b, inputs: [in]}}\n  w: {{kind: servers, inputs: [x]{replicas}, config: {{servers: [a, b]}}}}\n"
        )
    };
    let g = check_with(&yaml(""), &[]).unwrap();
    assert_eq!(g.nodes.iter().find(|n| n.id == "w").unwrap().replicas, 2);
    assert!(check_with(&yaml(", replicas: 2"), &[]).is_ok());
    let e = errors(&yaml(", replicas: 3"));
    assert!(
        e.contains("g.yaml:5:")
            && e.contains("`replicas: 3`, but the servers config names 2 engine servers"),
        "{e}"
    );
}

#[test]
fn a_router_needs_a_worker_behind_it_and_forwarding_kinds_keep_their_type() {
    // Past a pass-through node to the worker: fine, and the plan names each role.
    let g = check_with(
        &format!("{HEADER}  in: {{kind: src}}\n  x: {{kind: a2b, inputs: [in]}}\n  r: {{kind: router, inputs: [x]}}\n  v: {{kind: via, inputs: [r]}}\n  w: {{kind: worker, inputs: [v]}}\n"),
        &[],
    )
    .unwrap();
    let roles: Vec<String> = Plan::new(&g)
        .nodes
        .iter()
        .map(|n| n.role.to_string())
        .collect();
    assert_eq!(
        roles,
        ["ingress", "stage", "router", "pass_through", "worker"]
    );
    // A stage with the same input and output type (a logger, say) is not a worker.
    insta::assert_snapshot!(errors(&format!(
        "{HEADER}  in: {{kind: src}}\n  x: {{kind: a2b, inputs: [in]}}\n  r: {{kind: router, inputs: [x]}}\n  log: {{kind: b2b, inputs: [r]}}\n  w: {{kind: worker, inputs: [log]}}\n  in2: {{kind: src}}\n  x2: {{kind: a2b, inputs: [in2]}}\n  r2: {{kind: router, inputs: [x2]}}\n  in3: {{kind: src}}\n  b: {{kind: bent_router, inputs: [in3]}}\n"
    )));
}

#[test]
fn a_cycle_of_pass_through_nodes_behind_a_router_is_reported_not_walked_forever() {
    let e = errors(&format!(
        "{HEADER}  in: {{kind: src}}\n  x: {{kind: a2b, inputs: [in]}}\n  r: {{kind: router, inputs: [x]}}\n  v1: {{kind: via, inputs: [r, v2]}}\n  v2: {{kind: via, inputs: [v1]}}\n"
    ));
    assert!(e.contains("cycle: "), "{e}");
}

#[test]
fn yaml_syntax_error_has_position() {
    insta::assert_snapshot!(errors("name: t\nnodes:\n  in: {kind: src\n  x: 1\n"));
}

#[test]
fn duplicate_key() {
    insta::assert_snapshot!(errors(&format!(
        "{HEADER}  in: {{kind: src}}\n  in: {{kind: src}}\n"
    )));
}

#[test]
fn top_level_unknown_field_and_missing_name() {
    insta::assert_snapshot!(errors("nme: t\nnodes: {}\n"));
}

#[test]
fn bad_plane_addresses() {
    insta::assert_snapshot!(errors(
        "name: t\nplanes:\n  control: etcd:/nope\n  events: redis://x:1\n  transfer: rdma\nnodes:\n  in: {kind: src}\n  x: {kind: a2b, inputs: [in]}\n"
    ));
}

#[test]
fn distributed_plane_addresses_are_accepted() {
    let g = check_with(
        "name: t\nplanes: {control: 'etcd://127.0.0.1:2379,10.0.0.2:2379', events: 'nats://127.0.0.1:4222'}\nnodes:\n  in: {kind: src}\n  x: {kind: a2b, inputs: [in]}\n",
        &[],
    )
    .unwrap();
    assert_eq!(g.control.to_string(), "etcd://127.0.0.1:2379,10.0.0.2:2379");
    assert_eq!(
        g.transfer,
        dyn_core::planes::TransferWire::Auto,
        "by default"
    );
    for (wire, want) in [
        ("ucx", dyn_core::planes::TransferWire::Ucx),
        ("tcp", dyn_core::planes::TransferWire::Tcp),
    ] {
        let g = check_with(
            &format!("name: t\nplanes: {{transfer: {wire}}}\nnodes:\n  in: {{kind: src}}\n  x: {{kind: a2b, inputs: [in]}}\n"),
            &[],
        )
        .unwrap();
        assert_eq!(g.transfer, want);
    }
}

#[test]
fn unknown_kind() {
    insta::assert_snapshot!(errors(&format!(
        "{HEADER}  in: {{kind: src}}\n  x:\n    kind: a2c\n    inputs: [in]\n"
    )));
}

#[test]
fn unknown_config_field_and_ill_typed_field() {
    insta::assert_snapshot!(errors(&format!(
        "{HEADER}  in: {{kind: src}}\n  x:\n    kind: a2b\n    inputs: [in]\n    config:\n      factr: 2\n  y:\n    kind: b2b\n    inputs: [x]\n    config:\n      factor: lots\n"
    )));
}

#[test]
fn unknown_node_field_and_bad_replicas() {
    insta::assert_snapshot!(errors(&format!(
        "{HEADER}  in: {{kind: src}}\n  x:\n    kind: a2b\n    input: [in]\n  y:\n    kind: a2b\n    inputs: [in]\n    replicas: 0\n"
    )));
}

#[test]
fn kind_validate_points_at_the_field() {
    insta::assert_snapshot!(errors(&format!(
        "{HEADER}  in: {{kind: src}}\n  x:\n    kind: a2b\n    inputs: [in]\n    config:\n      factor: 11\n"
    )));
}

#[test]
fn dangling_input() {
    insta::assert_snapshot!(errors(&format!(
        "{HEADER}  in: {{kind: src}}\n  x:\n    kind: a2b\n    inputs: [in, nowhere]\n"
    )));
}

#[test]
fn edge_type_mismatch_names_both_types() {
    let e = errors(&format!(
        "{HEADER}  in: {{kind: src}}\n  x: {{kind: b2b, inputs: [in]}}\n"
    ));
    assert!(e.contains("`A`") && e.contains("`B`"), "{e}");
    insta::assert_snapshot!(e);
}

#[test]
fn cycle() {
    insta::assert_snapshot!(errors(&format!(
        "{HEADER}  in: {{kind: src}}\n  x: {{kind: a2b, inputs: [in]}}\n  y: {{kind: b2b, inputs: [x, z]}}\n  z: {{kind: b2b, inputs: [y]}}\n"
    )));
}

#[test]
fn fan_out() {
    insta::assert_snapshot!(errors(&format!(
        "{HEADER}  in: {{kind: src}}\n  x: {{kind: a2b, inputs: [in]}}\n  y: {{kind: a2b, inputs: [in]}}\n"
    )));
}

#[test]
fn ingress_taking_inputs_and_ingress_without_consumer() {
    insta::assert_snapshot!(errors(&format!(
        "{HEADER}  in: {{kind: src}}\n  x: {{kind: a2b, inputs: [in]}}\n  in2: {{kind: src, inputs: [x]}}\n"
    )));
}

#[test]
fn path_must_end_in_the_ingress_response_type() {
    insta::assert_snapshot!(errors(&format!(
        "{HEADER}  in: {{kind: src}}\n  x: {{kind: a2l, inputs: [in]}}\n"
    )));
}

#[test]
fn placement_errors() {
    insta::assert_snapshot!(errors(&format!(
        "{HEADER}  in: {{kind: src, replicas: 2}}\n  x: {{kind: a2l, inputs: [in], process: workers, replicas: 2}}\n  y: {{kind: l2b, inputs: [x], process: workers, replicas: 3}}\n"
    )));
}

#[test]
fn local_types_are_fine_inside_the_ingress_process() {
    check_with(
        &format!("{HEADER}  in: {{kind: src, process: front}}\n  x: {{kind: a2l, inputs: [in], process: front}}\n  y: {{kind: l2b, inputs: [x], process: front}}\n"),
        &[],
    )
    .unwrap();
}

#[test]
fn every_error_is_reported_at_once() {
    let e = errors(&format!(
        "{HEADER}  in: {{kind: src}}\n  x: {{kind: nope, inputs: [in]}}\n  y: {{kind: b2b, inputs: [ghost]}}\n  z: {{kind: a2b, inputs: [in], config: {{factor: 99}}}}\n"
    ));
    for needle in [
        "unknown kind `nope`",
        "'ghost'",
        "at most 10",
        "feeds 2 nodes",
    ] {
        assert!(e.contains(needle), "missing {needle:?} in:\n{e}");
    }
    insta::assert_snapshot!(e);
}

#[test]
fn overrides_apply_and_are_checked() {
    let yaml = format!("{HEADER}  in: {{kind: src}}\n  x: {{kind: a2b, inputs: [in]}}\n");
    let ok: Vec<Override> = vec![
        "x.factor=3".parse().unwrap(),
        "x.replicas=4".parse().unwrap(),
    ];
    let g = check_with(&yaml, &ok).unwrap();
    assert_eq!(g.node("x").unwrap().replicas, 4);
    let bad: Vec<Override> = vec![
        "x.factor=50".parse().unwrap(),
        "ghost.factor=1".parse().unwrap(),
    ];
    insta::assert_snapshot!(check_with(&yaml, &bad).err().unwrap().to_string());
    assert!("nodot=1".parse::<Override>().is_err());
    assert!("x.factor".parse::<Override>().is_err());
}

#[test]
fn overrides_reach_the_graph_header() {
    let yaml = format!(
        "model: {{name: m, path: a}}\n{HEADER}  in: {{kind: src}}\n  x: {{kind: a2b, inputs: [in]}}\n"
    );
    let set: Vec<Override> = vec![
        "model.path=/models/b.gguf".parse().unwrap(),
        "model.name=b".parse().unwrap(),
    ];
    let (spec, _) = load_str("g.yaml", &yaml, &set).unwrap();
    let m = &spec.models[0];
    assert_eq!((m.name.as_str(), m.path.as_str()), ("b", "/models/b.gguf"));
    // A graph without a model section gets one; a wrong key is checked as if written.
    let bare = format!("{HEADER}  in: {{kind: src}}\n");
    let set: Vec<Override> = vec![
        "model.path=x".parse().unwrap(),
        "model.name=x".parse().unwrap(),
    ];
    assert_eq!(
        load_str("g.yaml", &bare, &set).unwrap().0.models[0].path,
        "x"
    );
    let bad: Vec<Override> = vec!["model.size=3".parse().unwrap()];
    let e = match load_str("g.yaml", &yaml, &bad) {
        Err(d) => d.to_string(),
        Ok((_, d)) => d.to_string(),
    };
    assert!(e.contains("size"), "{e}");
    // Nodes cannot take a section's name.
    let e = errors(&format!("{HEADER}  model: {{kind: src}}\n"));
    assert!(e.contains("names a section of the graph"), "{e}");
}

#[test]
fn unreached_service_node_is_a_warning() {
    let g = check_with(
        &format!(
            "{HEADER}  in: {{kind: src}}\n  x: {{kind: a2b, inputs: [in]}}\n  svc: {{kind: b2b}}\n"
        ),
        &[],
    )
    .unwrap();
    insta::assert_snapshot!(g.warnings.to_string());
}

#[test]
fn plan_renderings() {
    let g = check_with(
        &format!("{HEADER}  in: {{kind: src, process: front}}\n  x: {{kind: a2b, inputs: [in], process: front}}\n  y: {{kind: b2b, inputs: [x], replicas: 2}}\n"),
        &[],
    )
    .unwrap();
    let plan = Plan::new(&g);
    insta::assert_snapshot!("plan_text", plan.render(dyn_runtime::Format::Text));
    insta::assert_snapshot!("plan_dot", plan.render(dyn_runtime::Format::Dot));
    insta::assert_snapshot!("plan_mermaid", plan.render(dyn_runtime::Format::Mermaid));
    let json: serde_json::Value =
        serde_json::from_str(&plan.render(dyn_runtime::Format::Json)).unwrap();
    assert_eq!(json["processes"][1]["replicas"], 2);
}

const TWO_MODELS: &str =
    "name: t\nmodels:\n  - {name: m1, path: a}\n  - {name: m2, path: b}\nnodes:\n";

#[test]
fn an_ingress_feeds_one_path_per_model_and_each_node_serves_its_paths_model() {
    let g = check_with(
        &format!(
            "{TWO_MODELS}  in: {{kind: src}}\n  x1: {{kind: a2b, inputs: [in], model: m1}}\n  y1: {{kind: b2b, inputs: [x1]}}\n  x2: {{kind: a2b, inputs: [in], model: m2}}\n  y2: {{kind: b2b, inputs: [x2]}}\n"
        ),
        &[],
    )
    .unwrap();
    let paths: Vec<(Option<&str>, Vec<&str>)> = g
        .chains
        .iter()
        .map(|c| {
            let ids = c.path.iter().map(|&i| g.nodes[i].id.as_str()).collect();
            (c.model.as_deref(), ids)
        })
        .collect();
    assert_eq!(
        paths,
        [
            (Some("m1"), vec!["x1", "y1"]),
            (Some("m2"), vec!["x2", "y2"])
        ]
    );
    let model = |id: &str| g.node(id).unwrap().model.as_deref();
    assert_eq!((model("y1"), model("y2")), (Some("m1"), Some("m2")));
    let text = Plan::new(&g).render(dyn_runtime::Format::Text);
    assert!(
        text.contains("in → x2 → y2 ⇒ in answers with B (model m2)"),
        "{text}"
    );

    // Each path names its model; names are the graph's; a node serves one model; an ingress
    // feeds one path per model.
    let e = errors(&format!(
        "{TWO_MODELS}  in: {{kind: src}}\n  x1: {{kind: a2b, inputs: [in], model: m3}}\n  x2: {{kind: a2b, inputs: [in]}}\n"
    ));
    assert!(
        e.contains("`model: m3` is not one of the graph's models (`m1`, `m2`)"),
        "{e}"
    );
    assert!(
        e.contains("node 'x2': the graph serves several models: name this path's"),
        "{e}"
    );
    let e = errors(&format!(
        "{TWO_MODELS}  in: {{kind: src}}\n  x1: {{kind: a2b, inputs: [in], model: m1}}\n  x2: {{kind: a2b, inputs: [in], model: m1}}\n"
    ));
    assert!(
        e.contains("ingress 'in' feeds two paths of model `m1` ('x1' and 'x2')"),
        "{e}"
    );
    let e = errors(&format!(
        "{TWO_MODELS}  in: {{kind: src}}\n  x1: {{kind: a2b, inputs: [in], model: m1}}\n  y: {{kind: b2b, inputs: [x1], model: m2}}\n"
    ));
    assert!(
        e.contains("node 'y': serves `m2` but is on a path of `m1`"),
        "{e}"
    );
    let e =
        errors("name: t\nmodel: {name: m, path: a}\nmodels:\n  - {name: n, path: b}\nnodes: {}\n");
    assert!(
        e.contains("give `model` (one) or `models` (several), not both"),
        "{e}"
    );
    let e = errors(
        "name: t\nmodels:\n  - {name: m, path: a, loras: {x: d}}\n  - {name: x, path: b}\nnodes: {}\n",
    );
    assert!(e.contains("`x` is a model and an adapter of `m`"), "{e}");
}

#[test]
fn a_router_may_feed_several_worker_pools_that_feed_the_same_node() {
    let g = check_with(
        &format!(
            "{HEADER}  in: {{kind: src}}\n  x: {{kind: a2b, inputs: [in]}}\n  r: {{kind: router, inputs: [x]}}\n  short: {{kind: worker, inputs: [r]}}\n  long: {{kind: worker, inputs: [r], replicas: 2}}\n  post: {{kind: b2b, inputs: [short, long]}}\n"
        ),
        &[],
    )
    .unwrap();
    let c = &g.chains[0];
    let ids = |v: &[usize]| -> Vec<String> { v.iter().map(|&i| g.nodes[i].id.clone()).collect() };
    assert_eq!(ids(&c.path), ["x", "r", "short", "post"]);
    assert_eq!(ids(&c.pools[&2]), ["short", "long"]);
    let text = Plan::new(&g).render(dyn_runtime::Format::Text);
    assert!(text.contains("in → x → r → short|long → post"), "{text}");

    let e = errors(&format!(
        "{HEADER}  in: {{kind: src}}\n  x: {{kind: a2b, inputs: [in]}}\n  r: {{kind: router, inputs: [x]}}\n  short: {{kind: worker, inputs: [r]}}\n  long: {{kind: b2b, inputs: [r]}}\n  post: {{kind: b2b, inputs: [short]}}\n"
    ));
    assert!(e.contains("'long' (b2b) is a stage, not a worker"), "{e}");
    assert!(
        e.contains("pools of router 'r' must feed the same node: 'short' feeds 'post' but 'long' feeds nothing"),
        "{e}"
    );
    // Anything else still feeds one node.
    let e = errors(&format!(
        "{HEADER}  in: {{kind: src}}\n  x: {{kind: a2b, inputs: [in]}}\n  a: {{kind: b2b, inputs: [x]}}\n  b: {{kind: b2b, inputs: [x]}}\n"
    ));
    assert!(e.contains("node 'x' feeds 2 nodes ('a', 'b')"), "{e}");
}
