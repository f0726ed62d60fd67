//! The helpers every crate's Prometheus statics register through, and [`render`], served by the
//! `http` ingress at `GET /metrics`.
//!
//! Everything registers in the process's default registry, so one scrape of a process shows
//! its frontend and every worker it runs. Names follow Prometheus conventions (`_total` for
//! counters, base units in seconds) under `dyn_frontend_` and `dyn_worker_`.
//!
//! The metric families are process-wide, but a series labelled with one component (a worker,
//! a node's replica) belongs to that component: it binds its label values through [`Series`],
//! which removes them when the component is dropped. So a replica the planner removes, or a
//! failed one that was replaced, leaves `/metrics` with it, and scaling up and down does not
//! grow the page.

use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, TextEncoder,
    register_histogram_vec, register_int_counter_vec, register_int_gauge_vec,
};

fn or_unregistered<T>(r: prometheus::Result<T>, make: impl FnOnce() -> T) -> T {
    // Registration only fails for a duplicate name, which these statics rule out; fall back to
    // an unregistered metric rather than panic.
    r.unwrap_or_else(|e| {
        tracing::error!(error = %e, "Metric registration failed");
        make()
    })
}

pub fn counter_vec(name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    or_unregistered(register_int_counter_vec!(name, help, labels), || {
        IntCounterVec::new(Opts::new(name, help), labels).unwrap_or_else(|_| unreachable!())
    })
}

/// Latency buckets (seconds) from 1 ms to 60 s.
const LATENCY: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// Buckets (seconds) from 10 µs to 100 ms, for the work done inside one engine step.
pub const STEP_PARTS: &[f64] = &[
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1,
];

pub fn histogram(name: &str, help: &str, labels: &[&str]) -> HistogramVec {
    histogram_with(name, help, labels, LATENCY)
}

pub fn histogram_with(name: &str, help: &str, labels: &[&str], buckets: &[f64]) -> HistogramVec {
    let opts = HistogramOpts::new(name, help).buckets(buckets.to_vec());
    or_unregistered(register_histogram_vec!(opts.clone(), labels), || {
        HistogramVec::new(opts, labels).unwrap_or_else(|_| unreachable!())
    })
}

pub fn gauge(name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    or_unregistered(register_int_gauge_vec!(name, help, labels), || {
        IntGaugeVec::new(Opts::new(name, help), labels).unwrap_or_else(|_| unreachable!())
    })
}

/// Bring a counter up to an absolute count kept elsewhere.
pub fn set_counter(c: &prometheus::IntCounter, v: u64) {
    let d = v.saturating_sub(c.get());
    if d > 0 {
        c.inc_by(d);
    }
}

/// The default registry in Prometheus text format.
pub fn render() -> String {
    let mut buf = Vec::new();
    if let Err(e) = TextEncoder::new().encode(&prometheus::gather(), &mut buf) {
        tracing::error!(error = %e, "Cannot encode metrics");
    }
    String::from_utf8(buf).unwrap_or_default()
}

pub fn float_gauge(name: &str, help: &str, labels: &[&str]) -> prometheus::GaugeVec {
    or_unregistered(prometheus::register_gauge_vec!(name, help, labels), || {
        prometheus::GaugeVec::new(Opts::new(name, help), labels).unwrap_or_else(|_| unreachable!())
    })
}

/// The series one component bound in process-wide metric families, removed from them when it
/// is dropped (see the module docs).
#[derive(Default)]
pub struct Series(Vec<Box<dyn Fn() + Send + Sync>>);

impl Series {
    /// The series of `family` with `labels`, removed from it when `self` is dropped.
    pub fn bind<T>(
        &mut self,
        family: &'static prometheus::core::MetricVec<T>,
        labels: &[&str],
    ) -> T::M
    where
        T: prometheus::core::MetricVecBuilder,
    {
        let owned: Vec<String> = labels.iter().map(|l| (*l).to_owned()).collect();
        self.0.push(Box::new(move || {
            let l: Vec<&str> = owned.iter().map(String::as_str).collect();
            // Already gone is fine: another owner of the same labels removed it.
            let _ = family.remove_label_values(&l);
        }));
        family.with_label_values(labels)
    }
}

impl Drop for Series {
    fn drop(&mut self) {
        for remove in &self.0 {
            remove();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::LazyLock;

    static FAMILY: LazyLock<IntGaugeVec> =
        LazyLock::new(|| gauge("dyn_test_owned_series", "test", &["owner"]));

    #[test]
    fn a_series_leaves_the_page_with_its_owner() {
        let count = || render().matches("dyn_test_owned_series{").count();
        let mut a = Series::default();
        a.bind(&FAMILY, &["a"]).set(1);
        {
            let mut b = Series::default();
            b.bind(&FAMILY, &["b"]).set(2);
            assert_eq!(count(), 2);
        }
        assert_eq!(count(), 1);
        drop(a);
        assert_eq!(count(), 0);
    }
}
