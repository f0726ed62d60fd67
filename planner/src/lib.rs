//! dyn-planner: the SLA planner (its config, observations, predictors, profiles, decisions
//! and published state) and its `dyn_planner_*` metrics ([`metrics`]). It must not depend on
//! the frontend or any engine: the frontend reads its published state, engines only report
//! load on the event plane.
//!
//! The SLA planner: replica counts follow the load so TTFT and ITL stay under their targets.
//!
//! Every `interval_s` the planner takes what the frontends and workers published on the event
//! plane during the interval ([`observe`]: request rate, prompt and output lengths, TTFT and
//! ITL percentiles, queued requests, KV usage), predicts the next interval's load
//! ([`predict`]: Holt's linear trend by default), turns it into replicas per node with the
//! worker's measured performance ([`profile`], written by `dyn graph profile`) or, without a
//! profile, reacts to the targets being missed or met with room to spare ([`decide`]), and
//! asks a [`dyn_core::Connector`] for that many replicas: in-process replicas in an
//! embedded run, `dyn` processes under the supervisor in a multi-process one. It publishes each
//! decision ([`state`]), which the `http` ingress serves at `/admin/planner` (`dyn inspect
//! planner`) and as `dyn_planner_*` metrics.
//!
//! The graph names it in a top-level section:
//!
//! ```yaml
//! planner:
//!   ttft_ms: 500          # targets, at `percentile`
//!   itl_ms: 40
//!   percentile: 90
//!   interval_s: 10        # how often it decides
//!   cooldown_s: 30        # no scale-down sooner than this after any change
//!   profile: decode.profile.json
//!   nodes:
//!     decode: {min: 1, max: 4}
//! ```

pub mod config;
pub mod decide;
pub mod metrics;
pub mod observe;
pub mod predict;
pub mod profile;
pub mod run;
pub mod state;
pub mod stats;

pub use config::PlannerConfig;
pub use run::run;
