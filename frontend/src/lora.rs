//! The LoRA adapters the OpenAI ingress serves beside its models, with vLLM's API:
//!
//! - each model's `loras` in the graph (name → PEFT directory or GGUF LoRA file), checked
//!   against the model's shapes when the ingress starts;
//! - `POST /v1/load_lora_adapter {lora_name, lora_path}` and `POST /v1/unload_lora_adapter
//!   {lora_name}` at run time. They make the server read files and change what every tenant
//!   is served, so, like `/admin`, they answer loopback clients only, with the `admin_key`
//!   where one is set (not the tenants' API keys), and only JSON bodies (a web page cannot
//!   send one without a preflight). Where the ingress serves several models, `base_model_name`
//!   says which one an adapter is for; without it, the first whose shapes it fits;
//! - `GET /v1/models` lists each model, then its adapters, each with its `parent` and `root`
//!   as vLLM does, but `root` is the model's or adapter's name where vLLM shows the path it
//!   was loaded from: every tenant may list models, and the server's files are not theirs to
//!   see. A request whose `model` is an adapter's name runs with it.
//!
//! The ingress resolves the name: the request carries the adapter's name, path and loading
//! ([`LoraRef`]) to whichever worker serves it, which reads it on first use
//! (`dyn_engine::lora`). Ingresses of one graph tell each other what they load and unload on
//! the event plane (`dyn.{namespace}.lora_adapters`, for their model), so every frontend
//! serves the same adapters. An ingress that starts says hello there, and the others announce
//! what they serve, so one started (or restarted) later serves the adapters loaded before it
//! too.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::{ConnectInfo, Extension, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use dyn_core::planes::EventBus;
use dyn_core::{BuildCx, BuildError};
use dyn_model::ModelConfig;
use dyn_model::files::shown;
use dyn_model::lora::LoraAdapter;
use dyn_protocol::types::LoraRef;
use futures::StreamExt;
use parking_lot::RwLock;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::ApiError;

/// The adapters an ingress serves, by name.
pub struct Adapters {
    base: String,
    base_path: PathBuf,
    /// The model's shape, read at the first adapter (none when the graph declares none).
    shape: tokio::sync::OnceCell<ModelConfig>,
    list: RwLock<BTreeMap<String, LoraRef>>,
    events: Arc<dyn EventBus>,
    subject: String,
    /// This ingress, in its own announcements (it ignores them when they come back).
    origin: u64,
    node: String,
}

/// What an ingress announces to the others.
#[derive(Debug, Serialize, Deserialize)]
struct Announce {
    origin: u64,
    /// The model the adapter is for: graphs sharing a namespace ignore each other's.
    parent: String,
    /// `None`: unloaded.
    load: Option<LoraRef>,
    name: String,
    /// An ingress that just started: the others tell it what they serve.
    #[serde(default)]
    hello: bool,
    /// Meant for this ingress only (an answer to its hello); others ignore it, so an answer
    /// crossing a later change elsewhere cannot undo that change there.
    #[serde(default)]
    to: Option<u64>,
}

/// The model's shape, read once (a GGUF file's whole header is parsed for it).
async fn shape_of(base_path: &Path) -> Result<ModelConfig, String> {
    let base = base_path.to_owned();
    tokio::task::spawn_blocking(move || {
        dyn_model::shape(&base).map_err(|e| format!("the model's shape ({}): {e}", base.display()))
    })
    .await
    .map_err(|e| format!("reading the model's shape failed: {e}"))?
}

/// The adapter `name` at `dir` (a PEFT directory or a GGUF LoRA file), checked against the
/// model's shapes (on the blocking pool: it reads every file, each bounded and a regular file
/// only, see `dyn_model::files`): its absolute path, and the version of its files.
async fn check(shape: &ModelConfig, name: &str, dir: &str) -> Result<LoraRef, String> {
    let (shape, dir, name) = (shape.clone(), PathBuf::from(dir), name.to_owned());
    tokio::task::spawn_blocking(move || {
        let adapter = LoraAdapter::load(&dir, &shape).map_err(|e| e.to_string())?;
        // Workers read the same path, whatever their working directory.
        let path = std::fs::canonicalize(&dir).map_err(|e| format!("{}: {e}", shown(&dir)))?;
        let mut h = std::collections::hash_map::DefaultHasher::new();
        std::hash::Hash::hash(&path, &mut h);
        // The version is what the files read said of themselves (fstat), not another look
        // at the paths.
        std::hash::Hash::hash(adapter.stamps(), &mut h);
        let lora = LoraRef {
            name,
            path: path.display().to_string(),
            id: std::hash::Hasher::finish(&h),
        };
        // A worker of this process takes this copy rather than reading the files again.
        dyn_model::lora::hand_over(lora.key(), &shape, std::sync::Arc::new(adapter));
        Ok(lora)
    })
    .await
    .map_err(|e| format!("adapter check failed: {e}"))?
}

impl Adapters {
    /// The graph's adapters, each checked against the model, and the announcements of other
    /// ingresses followed from now on.
    pub async fn start(
        cx: &BuildCx,
        model: &dyn_core::ModelSpec,
        base_path: PathBuf,
    ) -> Result<Arc<Self>, BuildError> {
        let base = &model.name;
        let mut list = BTreeMap::new();
        let shape = tokio::sync::OnceCell::new();
        for (name, path) in &model.loras {
            let bad = |e: String| BuildError::new(format!("{base}: loras.{name}: {e}"));
            let s = shape
                .get_or_try_init(|| shape_of(&base_path))
                .await
                .map_err(bad)?;
            let lora = check(s, name, &cx.resolve(path).display().to_string())
                .await
                .map_err(bad)?;
            list.insert(name.clone(), lora);
        }
        let subject = format!("dyn.{}.lora_adapters", cx.namespace);
        let adapters = Arc::new(Adapters {
            base: base.to_owned(),
            base_path,
            shape,
            list: RwLock::new(list),
            events: cx.planes.events.clone(),
            subject,
            origin: rand::random(),
            node: cx.node.clone(),
        });
        let mut announced = adapters
            .events
            .subscribe(&adapters.subject)
            .await
            .map_err(|e| BuildError::new(format!("LoRA announcements: {e}")))?;
        let weak = Arc::downgrade(&adapters);
        tokio::spawn(async move {
            while let Some(ev) = announced.next().await {
                let Some(this) = weak.upgrade() else { return };
                match serde_json::from_slice::<Announce>(&ev.payload) {
                    Ok(a) if a.origin == this.origin || a.parent != this.base => {}
                    Ok(a) if a.to.is_some_and(|to| to != this.origin) => {}
                    Ok(a) if a.hello => {
                        let held: Vec<(String, LoraRef)> = this
                            .list
                            .read()
                            .iter()
                            .map(|(n, l)| (n.clone(), l.clone()))
                            .collect();
                        for (name, lora) in held {
                            this.send(Announce {
                                origin: this.origin,
                                parent: this.base.clone(),
                                load: Some(lora),
                                name,
                                hello: false,
                                to: Some(a.origin),
                            })
                            .await;
                        }
                    }
                    Ok(a) => this.apply(a),
                    Err(e) => {
                        tracing::warn!(node = %this.node, error = %e, "Unreadable LoRA announcement")
                    }
                }
            }
        });
        // Subscribed first: the answers to this are heard.
        adapters
            .send(Announce {
                origin: adapters.origin,
                parent: adapters.base.clone(),
                load: None,
                name: String::new(),
                hello: true,
                to: None,
            })
            .await;
        Ok(adapters)
    }

    fn apply(&self, a: Announce) {
        let mut list = self.list.write();
        match a.load {
            Some(lora) => {
                tracing::info!(node = %self.node, lora = %lora.name, path = ?lora.path, "LoRA adapter loaded by another ingress");
                list.insert(a.name, lora);
            }
            None => {
                tracing::info!(node = %self.node, lora = %a.name, "LoRA adapter unloaded by another ingress");
                list.remove(&a.name);
            }
        }
    }

    async fn announce(&self, name: &str, load: Option<LoraRef>) {
        self.send(Announce {
            origin: self.origin,
            parent: self.base.clone(),
            load,
            name: name.to_owned(),
            hello: false,
            to: None,
        })
        .await;
    }

    async fn send(&self, a: Announce) {
        let payload = serde_json::to_vec(&a).unwrap_or_default();
        if let Err(e) = self.events.publish(&self.subject, payload.into()).await {
            tracing::warn!(node = %self.node, lora = %a.name, error = %e, "Other ingresses were not told of a LoRA adapter change");
        }
    }

    /// The model's name.
    pub fn base(&self) -> &str {
        &self.base
    }

    /// What a request's `model` names here: `Some(None)` the model itself, `Some(Some(_))`
    /// one of its adapters, `None` neither.
    pub fn find(&self, model: &str) -> Option<Option<LoraRef>> {
        if model == self.base {
            return Some(None);
        }
        self.list.read().get(model).map(|l| Some(l.clone()))
    }

    /// The model's name, then its adapters'.
    fn names(&self) -> Vec<String> {
        std::iter::once(self.base.clone())
            .chain(self.list.read().keys().cloned())
            .collect()
    }

    /// `/v1/models`' entries: the model, then its adapters (no paths: see the module's
    /// notes).
    pub fn models(&self, created: u64) -> Vec<Value> {
        let mut out = vec![json!({
            "id": self.base, "object": "model", "created": created, "owned_by": "dyn",
            "root": self.base, "parent": null,
        })];
        out.extend(self.list.read().values().map(|l| {
            json!({
                "id": l.name, "object": "model", "created": created, "owned_by": "dyn",
                "root": l.name, "parent": self.base,
            })
        }));
        out
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LoadBody {
    lora_name: String,
    lora_path: String,
    /// dyn's: which model the adapter is for, where the ingress serves several.
    #[serde(default)]
    base_model_name: Option<String>,
    /// vLLM's: replace an adapter already loaded under this name.
    #[serde(default)]
    load_inplace: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct UnloadBody {
    lora_name: String,
    /// vLLM's other way to name an adapter: refused (adapters here have names only).
    #[serde(default)]
    lora_int_id: Option<i64>,
}

/// An operator's request body: from a loopback client, as JSON.
fn operator_body<T: serde::de::DeserializeOwned>(
    peer: Option<Extension<ConnectInfo<SocketAddr>>>,
    headers: &HeaderMap,
    bytes: &Bytes,
) -> Result<T, ApiError> {
    loopback(peer)?;
    let json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_start().starts_with("application/json"));
    if !json {
        return Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "invalid_request_error",
            "unsupported_media_type",
            "send the body as JSON (content-type: application/json)",
        ));
    }
    serde_json::from_slice(bytes)
        .map_err(|e| ApiError::invalid("invalid_json", format!("invalid request body: {e}")))
}

fn loopback(peer: Option<Extension<ConnectInfo<SocketAddr>>>) -> Result<(), ApiError> {
    if peer.is_some_and(|c| c.0.0.ip().to_canonical().is_loopback()) {
        return Ok(());
    }
    Err(ApiError::new(
        StatusCode::FORBIDDEN,
        "invalid_request_error",
        "forbidden",
        "loading and unloading LoRA adapters is answered to loopback clients only",
    ))
}

/// Every model an ingress serves, with its adapters: what a request's `model` names.
pub struct Catalog(pub Vec<Arc<Adapters>>);

impl Catalog {
    /// The model a request's `model` names and its adapter (`None`: the model itself), or a
    /// 404 naming what is served.
    pub fn resolve(&self, model: &str) -> Result<(usize, Option<LoraRef>), ApiError> {
        for (i, a) in self.0.iter().enumerate() {
            if let Some(lora) = a.find(model) {
                return Ok((i, lora));
            }
        }
        let served = self
            .0
            .iter()
            .flat_map(|a| a.names())
            .map(|m| format!("`{m}`"))
            .collect::<Vec<_>>()
            .join(", ");
        // A 404, as OpenAI answers (its clients raise `NotFoundError`).
        Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "model_not_found",
            format!("The model `{model}` does not exist; this server serves {served}"),
        )
        .with_param("model"))
    }

    /// [`Catalog::resolve`] for a request that may leave `model` out: then the one model
    /// served (without its adapters), or a 400 naming the choice where there are several.
    pub fn resolve_or_only(
        &self,
        model: Option<&str>,
    ) -> Result<(usize, Option<LoraRef>), ApiError> {
        match (model, self.0.as_slice()) {
            (Some(m), _) => self.resolve(m),
            (None, [_]) => Ok((0, None)),
            (None, _) => {
                let names: Vec<String> = self
                    .0
                    .iter()
                    .flat_map(|a| a.names())
                    .map(|m| format!("`{m}`"))
                    .collect();
                Err(ApiError::invalid(
                    "missing_required_parameter",
                    format!(
                        "`model` is required: this server serves {}",
                        names.join(", ")
                    ),
                )
                .with_param("model"))
            }
        }
    }

    /// `GET /v1/models`: each model, then its adapters.
    pub fn models_body(&self, created: u64) -> Json<Value> {
        let data: Vec<Value> = self.0.iter().flat_map(|a| a.models(created)).collect();
        Json(json!({"object": "list", "data": data}))
    }
}

fn server_error(e: String) -> ApiError {
    ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "server_error",
        "internal_error",
        e,
    )
}

/// What a caller is told of a `lora_path` that is not loaded, whatever the reason: the same
/// words for a missing path, a file where a directory should be, an unreadable, oversized or
/// malformed file, or an adapter of another model, so that the answers do not map the
/// server's disk. The reason goes to the server's log.
pub const NOT_AN_ADAPTER: &str = "lora_path is not a LoRA adapter this server can read: a PEFT \
     directory (adapter_config.json, adapter_model.safetensors) or a GGUF LoRA file, of the \
     model's shapes (the server's log says why)";

/// The model `b` is for and the adapter checked against it: the one it names, the only one,
/// or the first whose shapes the files fit.
async fn load_target(
    catalog: &Catalog,
    b: &LoadBody,
) -> Result<(Arc<Adapters>, LoraRef), ApiError> {
    let candidates: Vec<&Arc<Adapters>> = match &b.base_model_name {
        Some(m) => match catalog.0.iter().find(|a| &a.base == m) {
            Some(a) => vec![a],
            None => {
                let served: Vec<&str> = catalog.0.iter().map(|a| a.base.as_str()).collect();
                return Err(ApiError::invalid(
                    "invalid_value",
                    format!(
                        "base_model_name `{m}` is not served here ({})",
                        served.join(", ")
                    ),
                )
                .with_param("base_model_name"));
            }
        },
        None => catalog.0.iter().collect(),
    };
    for a in candidates {
        let shape = a
            .shape
            .get_or_try_init(|| shape_of(&a.base_path))
            .await
            .map_err(server_error)?;
        match check(shape, &b.lora_name, &b.lora_path).await {
            Ok(lora) => return Ok((a.clone(), lora)),
            // Escaped: the path and the OS's words come from the caller's request, and a
            // newline in them must not forge a log line.
            Err(e) => tracing::warn!(
                node = %a.node, lora = ?b.lora_name, path = ?b.lora_path, model = %a.base,
                error = %e.escape_debug(), "Not loading a LoRA adapter"
            ),
        }
    }
    Err(ApiError::invalid("invalid_value", NOT_AN_ADAPTER).with_param("lora_path"))
}

/// `POST /v1/load_lora_adapter`.
pub async fn load(
    State(catalog): State<Arc<Catalog>>,
    peer: Option<Extension<ConnectInfo<SocketAddr>>>,
    headers: HeaderMap,
    bytes: Bytes,
) -> Result<Response, ApiError> {
    let b: LoadBody = operator_body(peer, &headers, &bytes)?;
    let name = b.lora_name.clone();
    let taken = || {
        ApiError::invalid(
            "invalid_value",
            format!("The lora adapter '{name}' has already been loaded."),
        )
        .with_param("lora_name")
    };
    // One name, one meaning: a model's name or another model's adapter cannot be reused.
    let holder = catalog.0.iter().find(|a| a.find(&name).is_some());
    for a in &catalog.0 {
        if let Some(p) = dyn_core::lora_name_problem(&name, &a.base) {
            return Err(ApiError::invalid("invalid_value", p).with_param("lora_name"));
        }
    }
    if holder.is_some() && !b.load_inplace {
        return Err(taken());
    }
    // Replaced in place: for the model that holds it, unless the body names another.
    let mut b = b;
    if let (Some(h), None) = (holder, &b.base_model_name) {
        b.base_model_name = Some(h.base.clone());
    }
    let (adapters, lora) = load_target(&catalog, &b).await?;
    if let Some(h) = holder
        && !Arc::ptr_eq(h, &adapters)
    {
        return Err(ApiError::invalid(
            "invalid_value",
            format!(
                "The lora adapter '{name}' is loaded for `{}`; unload it first",
                h.base
            ),
        )
        .with_param("lora_name"));
    }
    {
        // Checked again: another load of the name may have finished meanwhile.
        let mut list = adapters.list.write();
        if list.contains_key(&name) && !b.load_inplace {
            return Err(taken());
        }
        list.insert(name.clone(), lora.clone());
    }
    tracing::info!(node = %adapters.node, lora = %name, path = ?lora.path, model = %adapters.base, "LoRA adapter loaded");
    adapters.announce(&name, Some(lora)).await;
    Ok(format!("Success: LoRA adapter '{name}' added successfully.").into_response())
}

/// `POST /v1/unload_lora_adapter`.
pub async fn unload(
    State(catalog): State<Arc<Catalog>>,
    peer: Option<Extension<ConnectInfo<SocketAddr>>>,
    headers: HeaderMap,
    bytes: Bytes,
) -> Result<Response, ApiError> {
    let b: UnloadBody = operator_body(peer, &headers, &bytes)?;
    if b.lora_int_id.is_some() {
        return Err(ApiError::invalid(
            "invalid_value",
            "lora_int_id is not supported: name the adapter by lora_name",
        )
        .with_param("lora_int_id"));
    }
    let name = b.lora_name;
    let removed = catalog
        .0
        .iter()
        .find(|a| a.list.write().remove(&name).is_some());
    let Some(adapters) = removed else {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "model_not_found",
            format!("The lora adapter '{name}' cannot be found."),
        )
        .with_param("lora_name"));
    };
    tracing::info!(node = %adapters.node, lora = %name, "LoRA adapter unloaded");
    adapters.announce(&name, None).await;
    Ok(format!("Success: LoRA adapter '{name}' removed successfully.").into_response())
}

/// The routes, for the ingress's API router.
pub fn routes(catalog: Arc<Catalog>) -> axum::Router {
    axum::Router::new()
        .route("/v1/load_lora_adapter", axum::routing::post(load))
        .route("/v1/unload_lora_adapter", axum::routing::post(unload))
        .with_state(catalog)
}

#[cfg(test)]
mod tests {
    use super::*;
    use dyn_core::planes::Planes;

    fn spec() -> dyn_core::ModelSpec {
        dyn_core::ModelSpec {
            name: "tiny".into(),
            path: "models/tiny".into(),
            tool_parser: None,
            reasoning_parser: None,
            loras: Default::default(),
        }
    }

    async fn ingress(planes: &Planes, node: &str) -> Arc<Adapters> {
        let cx = BuildCx::for_tests(node, planes.clone());
        let base = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/tiny");
        Adapters::start(&cx, &spec(), base).await.unwrap()
    }

    #[tokio::test]
    async fn an_ingress_started_later_serves_the_adapters_loaded_before_it() {
        let planes = Planes::embedded();
        let a = ingress(&planes, "a").await;
        let lora = LoraRef {
            name: "qv".into(),
            path: "/adapters/qv".into(),
            id: 7,
        };
        a.list.write().insert("qv".into(), lora.clone());
        a.announce("qv", Some(lora.clone())).await;
        // Started after the load: it asks, and `a` tells it.
        let b = ingress(&planes, "b").await;
        dyn_tests::until("b serves qv", || b.find("qv").is_some()).await;
        assert_eq!(b.find("qv"), Some(Some(lora)));
        // Unloads reach it as before.
        a.list.write().remove("qv");
        a.announce("qv", None).await;
        dyn_tests::until("b no longer serves qv", || b.find("qv").is_none()).await;
    }

    #[tokio::test]
    async fn the_model_list_names_models_and_adapters_and_shows_no_path() {
        let a = ingress(&Planes::embedded(), "a").await;
        let lora = LoraRef {
            name: "qv".into(),
            path: "/srv/secret/adapters/qv".into(),
            id: 7,
        };
        a.list.write().insert("qv".into(), lora);
        let models = a.models(1);
        let roots: Vec<(&str, &str)> = models
            .iter()
            .map(|m| (m["id"].as_str().unwrap(), m["root"].as_str().unwrap()))
            .collect();
        assert_eq!(roots, [("tiny", "tiny"), ("qv", "qv")]);
        let text = serde_json::to_string(&models).unwrap();
        assert!(!text.contains('/'), "{text}");
    }
}
