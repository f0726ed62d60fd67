//! The CUDA backend: the same forward pass as [`crate::cpu`], on an NVIDIA GPU through cudarc,
//! which loads the driver, cuBLAS and NVRTC at run time — a build needs no CUDA toolkit, and a
//! machine without a driver gets an error from [`load`], never a panic.
//!
//! Matrix products go to cuBLAS (fp32 products stay fp32: no TF32); everything else is a
//! handful of kernels compiled by NVRTC from `kernels.cu` at start-up for the weights' storage
//! type: embedding gather, RMSNorm, bias, rope plus the KV-cache write, paged attention over
//! block tables, SiLU·mul, row gather, and the KV block copy that stages blocks for export and
//! import. Activations and the KV cache are kept in the weights' type (f32, bf16 or f16); all
//! arithmetic inside kernels is f32. The residual additions ride on cuBLAS's `beta = 1`.
//!
//! LoRA adapters: each adapter's `Aᵀ` and scaled `Bᵀ` are uploaded once, in the weights' type
//! (the most recent [`MAX_DEVICE_LORAS`] kept); after each fused projection, each sequence
//! with an adapter gets two cuBLAS products on its own rows — its tokens are contiguous in the
//! batch — `T = X·Aᵀ`, then `Y[:, offset..] += T·Bᵀ` into its projection's columns of the fused
//! output (q/k/v, gate/up; o and down into the residual), before rope and the activation, as
//! the CPU backend adds them.
//!
//! This module holds the entry points ([`load`], [`compile_kernels`], [`copy_bandwidth`]);
//! the parts live in submodules by what they own: `engine` (the model on one GPU, its KV
//! cache and its `Backend`), `kernels` (the source, its NVRTC compile, the loaded functions),
//! `dtype` (the storage types), `batch` (a step's layout and device buffers), `forward` (the
//! pass itself), `lora` (adapters on the device) and `blocks` (KV block export and import).
//!
//! [`MAX_DEVICE_LORAS`]: lora::MAX_DEVICE_LORAS

#![allow(unsafe_code)]

use cudarc::driver::CudaContext;
use half::{bf16, f16};

use crate::backend::{Backend, ComputeError, KvShape};
use crate::model::{DType, ModelWeights};

mod batch;
mod blocks;
mod dtype;
mod engine;
mod forward;
mod kernels;
mod lora;

pub use dtype::DevFloat;
pub use kernels::compile_kernels;

use engine::Engine;

fn dev<E: std::fmt::Display>(what: &'static str) -> impl Fn(E) -> ComputeError {
    move |e| ComputeError::Device(format!("{what}: {e}"))
}

/// Whether a CUDA driver can be loaded here (checked before cudarc touches it: cudarc
/// panics when the library is absent).
pub fn driver_present() -> bool {
    // SAFETY: only tries to open the shared library by its usual names.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Start the backend on GPU `ordinal` with `w` in its own dtype (uploaded from the host
/// copy, which the caller keeps: a failed start can fall back to the CPU without reloading).
pub fn load(
    w: &ModelWeights,
    kv: KvShape,
    ordinal: usize,
) -> Result<Box<dyn Backend>, ComputeError> {
    if !driver_present() {
        return Err(ComputeError::Device(
            "no CUDA driver (libcuda) on this machine".into(),
        ));
    }
    // SAFETY: as above, for cuBLAS and NVRTC.
    let (blas, nvrtc) = unsafe {
        (
            cudarc::cublas::sys::is_culib_present(),
            cudarc::nvrtc::sys::is_culib_present(),
        )
    };
    if !blas || !nvrtc {
        return Err(ComputeError::Device(format!(
            "the CUDA driver is present but {} cannot be loaded (install the CUDA runtime libraries)",
            if blas { "NVRTC" } else { "cuBLAS" }
        )));
    }
    // Quantized GGUF matrices are widened to this dtype as they are uploaded.
    match w.dtype {
        DType::F32 => Ok(Box::new(Engine::<f32>::new(w, kv, ordinal)?)),
        DType::Bf16 => Ok(Box::new(Engine::<bf16>::new(w, kv, ordinal)?)),
        DType::F16 => Ok(Box::new(Engine::<f16>::new(w, kv, ordinal)?)),
    }
}

/// Device memory bandwidth in GB/s (bytes read plus written), measured by copying 1 GiB
/// device to device, best of three: the roofline for decode on GPU `ordinal`.
pub fn copy_bandwidth(ordinal: usize) -> Result<f64, ComputeError> {
    if !driver_present() {
        return Err(ComputeError::Device(
            "no CUDA driver (libcuda) on this machine".into(),
        ));
    }
    let ctx = CudaContext::new(ordinal).map_err(dev("opening the GPU"))?;
    let stream = ctx.default_stream();
    let n = 256 << 20; // u32s
    let src = stream.alloc_zeros::<u32>(n).map_err(dev("allocating"))?;
    let mut dst = stream.alloc_zeros::<u32>(n).map_err(dev("allocating"))?;
    let mut best: f64 = 0.0;
    for _ in 0..3 {
        stream.synchronize().map_err(dev("synchronizing"))?;
        let t = std::time::Instant::now();
        stream.memcpy_dtod(&src, &mut dst).map_err(dev("copying"))?;
        stream.synchronize().map_err(dev("synchronizing"))?;
        best = best.max(2.0 * (n * 4) as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    Ok(best)
}

fn int(n: usize) -> Result<i32, ComputeError> {
    i32::try_from(n)
        .map_err(|_| ComputeError::Invalid(format!("{n} does not fit a kernel argument")))
}
