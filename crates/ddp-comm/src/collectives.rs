//! [`Collectives`]: the one interface of a process group, in the shape of PyTorch's c10d
//! `ProcessGroup` (Gloo and NCCL behind one API). [`ProcessGroup`] implements it on host
//! memory (`[f32]`, over shared memory and TCP); `ddp-nccl`'s `NcclGroup` implements it on
//! CUDA device memory. Code written against it runs the same calls on CPU ranks — where
//! every test runs — as on GPUs.
//!
//! Every method is a collective: every rank calls it, in the same order, with the same sizes.

use crate::error::Result;
use crate::group::{Compression, ProcessGroup, ReduceOp};

/// The collectives of a process group over buffers of type [`Collectives::Buffer`] (see the
/// [module docs](self)).
pub trait Collectives {
    /// The memory the collectives read and write: f32 values on the host for
    /// [`ProcessGroup`], a device buffer for NCCL.
    type Buffer: ?Sized;

    /// This process's rank, `0..world_size`.
    fn rank(&self) -> usize;

    /// The number of ranks.
    fn world_size(&self) -> usize;

    /// Reduces `buf` element-wise across ranks, in place; every rank gets the result. The
    /// values travel as `compression` says (16-bit values for `Bf16`/`Fp16`, which only
    /// [`ReduceOp::Sum`] and [`ReduceOp::Mean`] support). How is the implementation's:
    /// [`ProcessGroup`] takes f32 values, sends them as 16 bits and sums in f32; NCCL takes a
    /// buffer already holding 16-bit values (the caller casts on the device) and sums in 16
    /// bits.
    ///
    /// # Errors
    /// Any failure of the group (a dead peer, a timeout, mismatched calls), which breaks it.
    fn all_reduce(
        &mut self,
        buf: &mut Self::Buffer,
        op: ReduceOp,
        compression: Compression,
    ) -> Result<()>;

    /// [`Self::all_reduce`] of several buffers, in order (an implementation may run them as
    /// one call).
    ///
    /// # Errors
    /// As [`Self::all_reduce`].
    fn all_reduce_many(
        &mut self,
        bufs: &mut [&mut Self::Buffer],
        op: ReduceOp,
        compression: Compression,
    ) -> Result<()> {
        for buf in bufs {
            self.all_reduce(buf, op, compression)?;
        }
        Ok(())
    }

    /// Reduces `buf` across ranks, leaving on each rank its own shard reduced: `buf` holds one
    /// shard per rank in rank order, rank `p`'s of `counts[p]` values (adding up to the
    /// buffer's length, the same on every rank). Values outside this rank's shard are
    /// unspecified afterwards.
    ///
    /// # Errors
    /// `counts` that do not fit the buffer; as [`Self::all_reduce`].
    fn reduce_scatter(
        &mut self,
        buf: &mut Self::Buffer,
        counts: &[usize],
        op: ReduceOp,
        compression: Compression,
    ) -> Result<()>;

    /// Gathers every rank's shard of `buf` into every rank's `buf`: rank `p`'s shard of
    /// `counts[p]` values, in rank order, is its input.
    ///
    /// # Errors
    /// As [`Self::reduce_scatter`].
    fn all_gather_into(&mut self, buf: &mut Self::Buffer, counts: &[usize]) -> Result<()>;

    /// Copies `root`'s `buf` into every rank's `buf` (the same length everywhere).
    ///
    /// # Errors
    /// A root out of range; as [`Self::all_reduce`].
    fn broadcast(&mut self, buf: &mut Self::Buffer, root: usize) -> Result<()>;

    /// Returns once every rank has called it.
    ///
    /// # Errors
    /// As [`Self::all_reduce`].
    fn barrier(&mut self) -> Result<()>;
}

/// The host group: shared memory between the ranks of a host, TCP between hosts; every
/// element summed in rank order, so results are bitwise independent of the layout.
impl Collectives for ProcessGroup {
    type Buffer = [f32];

    fn rank(&self) -> usize {
        ProcessGroup::rank(self)
    }

    fn world_size(&self) -> usize {
        ProcessGroup::world_size(self)
    }

    fn all_reduce(
        &mut self,
        buf: &mut [f32],
        op: ReduceOp,
        compression: Compression,
    ) -> Result<()> {
        self.all_reduce_compressed(buf, op, compression)
    }

    fn reduce_scatter(
        &mut self,
        buf: &mut [f32],
        counts: &[usize],
        op: ReduceOp,
        compression: Compression,
    ) -> Result<()> {
        self.reduce_scatter_compressed(buf, counts, op, compression)
    }

    fn all_gather_into(&mut self, buf: &mut [f32], counts: &[usize]) -> Result<()> {
        ProcessGroup::all_gather_into(self, buf, counts)
    }

    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<()> {
        ProcessGroup::broadcast(self, buf, root)
    }

    fn barrier(&mut self) -> Result<()> {
        ProcessGroup::barrier(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::group::tests::{opts, run_ranks};

    /// A step written once against the trait: a mean all-reduce, a reduce-scatter to owners,
    /// an all-gather of the owners' results and a broadcast, as a sharded optimizer makes
    /// them. Run over the host group it is bitwise the group's own calls, on shared memory
    /// and TCP, plain and compressed.
    fn sharded_step<C: Collectives<Buffer = [f32]>>(
        c: &mut C,
        grads: &[f32],
        compression: Compression,
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let n = c.world_size();
        let mut counts = vec![grads.len() / n; n];
        counts[0] += grads.len() % n;
        let mut reduced = grads.to_vec();
        c.all_reduce(&mut reduced, ReduceOp::Mean, compression)
            .unwrap();
        let mut shards = grads.to_vec();
        c.reduce_scatter(&mut shards, &counts, ReduceOp::Mean, compression)
            .unwrap();
        // Each owner "steps" its shard (doubles it) and the shards are gathered.
        let at: usize = counts[..c.rank()].iter().sum();
        for v in &mut shards[at..at + counts[c.rank()]] {
            *v *= 2.0;
        }
        c.all_gather_into(&mut shards, &counts).unwrap();
        let mut from_root = grads.to_vec();
        c.broadcast(&mut from_root, n - 1).unwrap();
        c.barrier().unwrap();
        (reduced, shards, from_root)
    }

    #[test]
    fn a_step_written_against_the_trait_is_the_host_groups_own_calls_bitwise() {
        for shm in [true, false] {
            for compression in [Compression::None, Compression::Bf16] {
                let res = run_ranks(3, opts(shm), move |pg| {
                    let r = pg.rank();
                    let grads: Vec<f32> = (0..1001).map(|i| (i * (r + 1)) as f32 * 0.37).collect();
                    let via_trait = sharded_step(pg, &grads, compression);
                    let mut want = grads.clone();
                    pg.all_reduce_compressed(&mut want, ReduceOp::Mean, compression)
                        .unwrap();
                    (via_trait, want, grads)
                });
                let roots = res[2].2.clone();
                for (rank, ((reduced, gathered, from_root), want, _)) in res.iter().enumerate() {
                    assert_eq!(reduced, want, "all-reduce, rank {rank}, shm {shm}");
                    // Every rank holds every owner's doubled mean: twice the all-reduce.
                    let doubled: Vec<f32> = want.iter().map(|v| v * 2.0).collect();
                    assert_eq!(gathered, &doubled, "gather, rank {rank}, shm {shm}");
                    assert_eq!(from_root, &roots, "broadcast, rank {rank}");
                }
            }
        }
    }
}
