//! The models pass: which model each path and each node serves (the one a node on the path
//! names, else the graph's only model), one per node, one path per model for an ingress, and
//! for nodes off every path (a prefill pool a config calls) their callers' model.

use super::Compiler;

impl Compiler<'_> {
    /// The model of every path and node: the one a node on the path names (`model:`), else
    /// the graph's only model; a node serves one model, and an ingress one path per model.
    /// Nodes off every path (a prefill pool a config calls) take their callers' model.
    pub(super) fn assign_models(&mut self) {
        let spec = self.spec;
        for (i, n) in spec.nodes.iter().enumerate() {
            if let Some((name, pos)) = &n.model {
                if spec.models.iter().all(|m| &m.name != name) {
                    let known: Vec<String> = spec
                        .models
                        .iter()
                        .map(|m| format!("`{}`", m.name))
                        .collect();
                    let msg = if known.is_empty() {
                        format!("`model: {name}`, but the graph names no model")
                    } else {
                        format!(
                            "`model: {name}` is not one of the graph's models ({})",
                            known.join(", ")
                        )
                    };
                    self.error(*pos, i, msg);
                    continue;
                }
                if self.parsed[i].as_ref().is_some_and(|(k, _)| k.is_ingress()) {
                    self.error(*pos, i, "an ingress serves the models of its paths; name the model on the first node of each path");
                    continue;
                }
                self.model[i] = Some(name.clone());
            }
        }
        let only = match spec.models.as_slice() {
            [m] => Some(m.name.clone()),
            _ => None,
        };
        for c in 0..self.chains.len() {
            let nodes: Vec<usize> = self.chains[c].nodes().collect();
            let named: Vec<(usize, String)> = nodes
                .iter()
                .filter_map(|&j| self.model[j].clone().map(|m| (j, m)))
                .collect();
            let model = match named.first() {
                Some((_, m)) => Some(m.clone()),
                None if spec.models.len() > 1 => {
                    if let Some(&first) = self.chains[c].path.first() {
                        let ingress = &spec.nodes[self.chains[c].ingress].id;
                        let msg = format!(
                            "the graph serves several models: name this path's (from ingress '{ingress}') with `model:` on its first node"
                        );
                        self.error(spec.nodes[first].pos, first, msg);
                    }
                    None
                }
                None => only.clone(),
            };
            for (j, m) in &named {
                if Some(m) != model.as_ref() {
                    let msg = format!(
                        "serves `{m}` but is on a path of `{}` (from '{}')",
                        model.as_deref().unwrap_or_default(),
                        spec.nodes[named[0].0].id
                    );
                    self.error(spec.nodes[*j].model.as_ref().and_then(|m| m.1), *j, msg);
                }
            }
            self.chains[c].model = model;
        }
        // Each node on paths: their model, one.
        let mut seen: Vec<Option<(String, usize)>> = vec![None; spec.nodes.len()];
        for c in 0..self.chains.len() {
            let Some(m) = self.chains[c].model.clone() else {
                continue;
            };
            for j in self.chains[c].nodes().collect::<Vec<_>>() {
                match &seen[j] {
                    Some((other, _)) if *other != m => {
                        let msg = format!(
                            "is on paths of two models (`{other}` and `{m}`); a node serves one: give each model nodes of its own"
                        );
                        self.error(spec.nodes[j].pos, j, msg);
                    }
                    _ => {
                        seen[j] = Some((m.clone(), c));
                        self.model[j] = Some(m.clone());
                    }
                }
            }
        }
        // An ingress: one path per model (with fewer models, the fan-out pass said it).
        for a in (0..self.chains.len()).filter(|_| spec.models.len() > 1) {
            for b in 0..a {
                let (x, y) = (&self.chains[a], &self.chains[b]);
                if x.ingress == y.ingress && x.model == y.model && x.path.first() != y.path.first()
                {
                    let (ingress, first) =
                        (x.ingress, x.path.first().copied().unwrap_or(x.ingress));
                    let msg = format!(
                        "ingress '{}' feeds two paths of {} ('{}' and '{}'); it picks a path by the request's model, so each path serves another (`model:` on its first node)",
                        spec.nodes[ingress].id,
                        x.model
                            .as_ref()
                            .map_or("no model".to_owned(), |m| format!("model `{m}`")),
                        y.path.first().map_or("", |&f| spec.nodes[f].id.as_str()),
                        spec.nodes[first].id,
                    );
                    self.error(spec.nodes[first].pos, first, msg);
                }
            }
        }
        // Off every path: the callers' model (a prefill pool serves its caller's model).
        for i in 0..spec.nodes.len() {
            let callers: Vec<String> = self.callers[i]
                .iter()
                .filter_map(|&c| self.model[c].clone())
                .collect();
            match (&self.model[i], callers.first()) {
                (None, _) => {
                    self.model[i] = callers.first().cloned().or_else(|| only.clone());
                }
                (Some(m), Some(c)) if m != c && !self.on_chain[i] => {
                    let msg = format!("serves `{m}` but is called by a node of `{c}`");
                    self.error(spec.nodes[i].model.as_ref().and_then(|m| m.1), i, msg);
                }
                _ => {}
            }
        }
    }
}
