//! dyn-gpu: compute backends for the native engine and KV transfer.
//!
//! [`transfer`] moves KV-cache blocks between workers (disaggregated prefill). Besides, it
//! answers one question the graph compiler asks: was this build made with CUDA support? A node placed with `device: cuda` in a build without it runs on CPU, with a
//! warning at compile time. The CPU and CUDA backends (cudarc: cuBLAS + NVRTC kernels) land
//! with the native-engine work and build and test without a GPU.

pub mod transfer;

/// True when the `cuda` feature was enabled at build time.
pub const fn cuda_compiled() -> bool {
    cfg!(feature = "cuda")
}

#[cfg(test)]
mod tests {
    #[test]
    fn cuda_flag_matches_feature() {
        assert_eq!(super::cuda_compiled(), cfg!(feature = "cuda"));
    }
}
