//! dyn-runtime: graph files, their compiler and planner, the planes that leave the process
//! (etcd, NATS, TCP), and running a graph in one process or many.
//!
//! It builds on `dyn-core` (operators, kinds, the plane traits and their embedded
//! implementations) and knows nothing about LLMs: the kinds it runs come from a
//! `dyn_core::Registry` its caller fills (`dyn-kinds`). Only the binary and the crates that
//! start graphs depend on it; a kind crate needs `dyn-core` alone.

pub mod compile;
pub mod diag;
pub mod plan;
pub mod planes;
pub mod run;
pub mod spec;

pub use compile::{CompiledGraph, compile, load_and_compile};
pub use diag::{Diagnostic, Diagnostics, Pos, Severity};
pub use plan::{Format, Plan};
pub use run::{Attach, Placement, RunOptions, run, run_attached};

/// Exit code for configuration errors (`EX_CONFIG` from sysexits.h).
pub const EXIT_CONFIG: i32 = 78;
