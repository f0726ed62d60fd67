//! The kernels: `kernels.cu`, compiled by NVRTC at start-up for the weights' storage type
//! (its `#define` ahead of the source), the functions the backend loads from the module, and
//! the one-dimensional launch shape most of them use.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaModule, LaunchConfig};
use half::{bf16, f16};

use super::{DevFloat, dev};
use crate::backend::ComputeError;
use crate::model::DType;

const KERNELS: &str = include_str!("kernels.cu");

/// Compile the kernels for `dtype` to PTX with NVRTC (no GPU needed): what start-up does
/// before loading them, exposed so the kernel source is checked wherever NVRTC is installed.
pub fn compile_kernels(dtype: DType) -> Result<usize, ComputeError> {
    // SAFETY: only tries to open the shared library by its usual names.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(ComputeError::Device(
            "NVRTC (libnvrtc) cannot be loaded".into(),
        ));
    }
    let define = match dtype {
        DType::F32 => f32::DEFINE,
        DType::Bf16 => bf16::DEFINE,
        DType::F16 => f16::DEFINE,
    };
    let ptx = cudarc::nvrtc::compile_ptx(format!("{define}{KERNELS}"))
        .map_err(dev("compiling the kernels"))?;
    Ok(ptx.to_src().len())
}

pub(super) struct Funcs {
    pub(super) embedding: CudaFunction,
    pub(super) rmsnorm: CudaFunction,
    pub(super) add_bias: CudaFunction,
    pub(super) rope_store: CudaFunction,
    pub(super) paged_attention: CudaFunction,
    pub(super) silu_mul: CudaFunction,
    pub(super) gather_rows: CudaFunction,
    pub(super) kv_block_copy: CudaFunction,
    pub(super) to_f32: CudaFunction,
    _module: Arc<CudaModule>,
}

impl Funcs {
    /// Compile the kernels with `define` (the storage type's) ahead of the source and load
    /// them into `ctx`: what start-up does once the context and cuBLAS are up.
    pub(super) fn load(ctx: &Arc<CudaContext>, define: &str) -> Result<Self, ComputeError> {
        let src = format!("{define}{KERNELS}");
        let ptx = cudarc::nvrtc::compile_ptx(src).map_err(dev("compiling the kernels"))?;
        let module = ctx.load_module(ptx).map_err(dev("loading the kernels"))?;
        let func = |name: &str| module.load_function(name).map_err(dev("loading a kernel"));
        Ok(Funcs {
            embedding: func("embedding")?,
            rmsnorm: func("rmsnorm")?,
            add_bias: func("add_bias")?,
            rope_store: func("rope_store")?,
            paged_attention: func("paged_attention")?,
            silu_mul: func("silu_mul")?,
            gather_rows: func("gather_rows")?,
            kv_block_copy: func("kv_block_copy")?,
            to_f32: func("to_f32")?,
            _module: module.clone(),
        })
    }
}

pub(super) fn grid(n: usize, threads: u32, shared: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: shared,
    }
}
