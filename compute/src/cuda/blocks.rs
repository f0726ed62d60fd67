//! KV blocks in and out of the cache, for transfers between workers: a block's size in
//! elements, and the gather (export) or scatter (import) of many blocks through one staging
//! buffer with the block copy kernel.

use cudarc::cublas::{CudaBlas, Gemm};
use cudarc::driver::PushKernelArg;

use super::engine::Engine;
use super::kernels::grid;
use super::{DevFloat, dev, int};
use crate::backend::{Backend, ComputeError};

impl<T: DevFloat> Engine<T>
where
    CudaBlas: Gemm<T>,
{
    pub(super) fn block_elems(&self) -> usize {
        self.cfg.kv_heads * self.kv.block_size * self.cfg.head_dim
    }

    /// Gather (export) or scatter (import) `ids`' blocks through a staging buffer with the
    /// block copy kernel: one launch and one transfer per layer and K/V, not one per block.
    pub(super) fn copy_blocks(
        &mut self,
        ids: &[u32],
        data: Option<&[&[u8]]>,
    ) -> Result<Vec<Vec<u8>>, ComputeError> {
        self.bind()?;
        let be = self.block_elems();
        let n = ids.len();
        if let Some(b) = ids.iter().find(|b| **b as usize >= self.kv.num_blocks) {
            return Err(ComputeError::Invalid(format!("no block {b}")));
        }
        let ids_i: Vec<i32> = ids
            .iter()
            .map(|b| int(*b as usize))
            .collect::<Result<_, _>>()?;
        let d_ids = self
            .stream
            .clone_htod(&ids_i)
            .map_err(dev("uploading block ids"))?;
        let mut out = vec![Vec::with_capacity(self.block_bytes()); n];
        let size = std::mem::size_of::<T>();
        let bei = int(be)?;
        for li in 0..self.cfg.layers {
            for which in 0..2 {
                let mut staging = match data {
                    Some(blocks) => {
                        let mut host = Vec::with_capacity(n * be);
                        for b in blocks {
                            let at = (2 * li + which) * be * size;
                            host.extend(T::from_le(&b[at..at + be * size]));
                        }
                        self.stream
                            .clone_htod(&host)
                            .map_err(dev("staging blocks"))?
                    }
                    None => self.alloc(n * be)?,
                };
                let to_cache = i32::from(data.is_some());
                let cache = if which == 0 {
                    &mut self.k[li]
                } else {
                    &mut self.v[li]
                };
                let mut l = self.stream.launch_builder(&self.f.kv_block_copy);
                l.arg(cache)
                    .arg(&mut staging)
                    .arg(&d_ids)
                    .arg(&bei)
                    .arg(&to_cache);
                // SAFETY: ids are inside the cache (checked above); staging holds n blocks.
                unsafe { l.launch(grid(n, 256, 0)) }.map_err(dev("kv_block_copy"))?;
                if data.is_none() {
                    let host = self
                        .stream
                        .clone_dtoh(&staging)
                        .map_err(dev("reading blocks"))?;
                    for (i, o) in out.iter_mut().enumerate() {
                        o.extend(T::to_le(&host[i * be..(i + 1) * be]));
                    }
                }
            }
        }
        if data.is_some() {
            self.stream.synchronize().map_err(dev("importing blocks"))?;
        }
        Ok(out)
    }
}
