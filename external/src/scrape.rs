//! An engine server's load, read from its Prometheus `/metrics` and published as dyn's
//! [`LoadMetrics`], so routers (`least_loaded`, the `busy` count) and `dyn inspect workers`
//! see a vLLM or llama.cpp replica as they see dyn's own engines.
//!
//! vLLM: `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`,
//! `vllm:prefix_cache_{hits,queries}_total`, and `vllm:cache_config_info`'s `block_size` and
//! `num_gpu_blocks` labels. llama.cpp (`--metrics`): `llamacpp:requests_processing`,
//! `llamacpp:requests_deferred`, `llamacpp:prompt_tokens_{cached_,}total`.
//!
//! vLLM's speed, for the `kv` router's time cost, comes from its lifetime histograms: the step
//! time from the mean inter-token latency (`vllm:inter_token_latency_seconds`, or
//! `vllm:time_per_output_token_seconds` in older versions), the prefill cost per token from
//! `vllm:request_prefill_time_seconds` over the prompt tokens it computed (prompt tokens less
//! prefix-cache hits). llama.cpp reports neither: routers use the pool's other workers' or
//! their defaults.

use std::time::Duration;

use dyn_core::BuildCx;
use dyn_protocol::kv::{LoadMetrics, load_metrics_subject};
use openmetrics_parser::PrometheusValue;
use openmetrics_parser::prometheus::parse_prometheus;
use tokio::sync::watch;

use super::config::ExternalKind;
use super::server::Endpoint;

/// Read a scrape into load metrics; `block_size` where the server does not say.
pub fn read(kind: ExternalKind, text: &str, block_size: u32) -> LoadMetrics {
    let Ok(scrape) = parse_prometheus(text) else {
        return LoadMetrics::default();
    };
    // Summed over label sets (vLLM labels by engine index and model).
    let sum = |name: &str| -> f64 {
        scrape.families.get(name).map_or(0.0, |f| {
            f.iter_samples()
                .map(|s| match &s.value {
                    PrometheusValue::Gauge(v) | PrometheusValue::Unknown(v) => v.as_f64(),
                    PrometheusValue::Counter(c) => c.value.as_f64(),
                    _ => 0.0,
                })
                .sum()
        })
    };
    let label = |name: &str, label: &str| -> Option<u32> {
        let f = scrape.families.get(name)?;
        let s = f.iter_samples().next()?;
        s.get_labelset().ok()?.get_label_value(label)?.parse().ok()
    };
    // Σ sum and Σ count of a histogram.
    let histogram = |name: &str| -> (f64, f64) {
        scrape.families.get(name).map_or((0.0, 0.0), |f| {
            f.iter_samples()
                .fold((0.0, 0.0), |(s, n), x| match &x.value {
                    PrometheusValue::Histogram(h) => (
                        s + h.sum.as_ref().map_or(0.0, |v| v.as_f64()),
                        n + h.count.unwrap_or(0) as f64,
                    ),
                    _ => (s, n),
                })
        })
    };
    let mean_ms = |name: &str| {
        let (sum, n) = histogram(name);
        if n > 0.0 { sum * 1e3 / n } else { 0.0 }
    };
    let count = |v: f64| v.max(0.0).round() as u32;
    let rate = |hits: f64, total: f64| if total > 0.0 { hits / total } else { 0.0 };
    match kind {
        ExternalKind::Vllm => {
            let block_size = label("vllm:cache_config_info", "block_size").unwrap_or(block_size);
            let total = label("vllm:cache_config_info", "num_gpu_blocks").unwrap_or(0);
            LoadMetrics {
                requests_running: count(sum("vllm:num_requests_running")),
                requests_waiting: count(sum("vllm:num_requests_waiting")),
                kv_active_blocks: count(sum("vllm:kv_cache_usage_perc") * f64::from(total)),
                kv_total_blocks: total,
                prefix_cache_hit_rate: rate(
                    sum("vllm:prefix_cache_hits_total"),
                    sum("vllm:prefix_cache_queries_total"),
                ),
                block_size,
                step_ms: match mean_ms("vllm:inter_token_latency_seconds") {
                    0.0 => mean_ms("vllm:time_per_output_token_seconds"),
                    ms => ms,
                },
                prefill_ms_per_token: {
                    let computed =
                        sum("vllm:prompt_tokens_total") - sum("vllm:prefix_cache_hits_total");
                    let (seconds, _) = histogram("vllm:request_prefill_time_seconds");
                    if computed >= 1.0 {
                        seconds * 1e3 / computed
                    } else {
                        0.0
                    }
                },
                ..LoadMetrics::default()
            }
        }
        ExternalKind::Llamacpp | ExternalKind::Openai => LoadMetrics {
            requests_running: count(sum("llamacpp:requests_processing")),
            requests_waiting: count(sum("llamacpp:requests_deferred")),
            prefix_cache_hit_rate: rate(
                sum("llamacpp:prompt_tokens_cached_total"),
                sum("llamacpp:prompt_tokens_total"),
            ),
            block_size,
            ..LoadMetrics::default()
        },
    }
}

/// Scrape the replica's server every `interval` while it is up and publish its load.
pub async fn run(
    kind: ExternalKind,
    cx: &BuildCx,
    interval: Duration,
    block_size: u32,
    mut endpoint: watch::Receiver<Option<Endpoint>>,
) {
    let client = reqwest::Client::new();
    let subject = load_metrics_subject(&cx.namespace, &cx.node);
    let events = cx.planes.events.clone();
    let worker_id = cx.instance_id.get();
    let mut warned = false;
    loop {
        let base = endpoint
            .borrow_and_update()
            .as_ref()
            .map(|e| e.base.clone());
        let Some(base) = base else {
            if endpoint.changed().await.is_err() {
                return;
            }
            continue;
        };
        let text = async {
            client
                .get(format!("{base}/metrics"))
                .timeout(Duration::from_secs(2))
                .send()
                .await?
                .error_for_status()?
                .text()
                .await
        };
        match text.await {
            Ok(text) => {
                let m = LoadMetrics {
                    worker_id,
                    ..read(kind, &text, block_size)
                };
                if let Ok(payload) = serde_json::to_vec(&m)
                    && let Err(e) = events.publish(&subject, payload.into()).await
                {
                    tracing::debug!(error = %e, "Cannot publish an engine's load");
                }
            }
            Err(e) if !warned => {
                warned = true;
                tracing::warn!(url = %base, error = %e, "Cannot read the engine server's metrics (llama.cpp needs --metrics); its load is what routers count themselves");
            }
            Err(_) => {}
        }
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            changed = endpoint.changed() => if changed.is_err() { return },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_and_llamacpp_metrics_become_load() {
        let vllm = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 200.0
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 50.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="364",enable_prefix_caching="True"} 1.0
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 250.0
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.1",model_name="m"} 10.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} 10.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"} 0.3
vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 10.0
# TYPE vllm:request_prefill_time_seconds histogram
vllm:request_prefill_time_seconds_bucket{engine="0",le="+Inf",model_name="m"} 2.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 0.4
vllm:request_prefill_time_seconds_count{engine="0",model_name="m"} 2.0
"#;
        let m = read(ExternalKind::Vllm, vllm, 16);
        assert_eq!(
            (
                m.requests_running,
                m.requests_waiting,
                m.kv_active_blocks,
                m.kv_total_blocks,
                m.block_size
            ),
            (3, 1, 91, 364, 32)
        );
        assert!((m.prefix_cache_hit_rate - 0.25).abs() < 1e-9);
        // 30 ms a token; 400 ms of prefill over 250 − 50 computed tokens.
        assert!((m.step_ms - 30.0).abs() < 1e-9, "{}", m.step_ms);
        assert!(
            (m.prefill_ms_per_token - 2.0).abs() < 1e-9,
            "{}",
            m.prefill_ms_per_token
        );
        let llama = "# TYPE llamacpp:prompt_tokens_total counter\nllamacpp:prompt_tokens_total 10\n\
            # TYPE llamacpp:prompt_tokens_cached_total counter\nllamacpp:prompt_tokens_cached_total 5\n\
            # TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 2\n";
        let m = read(ExternalKind::Llamacpp, llama, 16);
        assert_eq!((m.requests_running, m.block_size), (2, 16));
        assert!((m.prefix_cache_hit_rate - 0.5).abs() < 1e-9);
        assert_eq!(
            read(ExternalKind::Vllm, "garbage {", 16).requests_running,
            0
        );
    }
}
