//! [`NcclGroup`]'s collectives over a buffer split into one shard per rank, of any sizes:
//! reduce-scatter and all-gather, as the process group offers them
//! ([`ddp_comm::ProcessGroup::reduce_scatter`], [`ddp_comm::ProcessGroup::all_gather_into`]).
//!
//! NCCL's own `ncclReduceScatter` and `ncclAllGather` take equal shards only, so uneven shards
//! run as one NCCL group call of `ncclReduce` (rooted at each shard's rank) or `ncclBroadcast`
//! (from each shard's rank) per shard, in place: NCCL schedules them together and the host
//! waits once. NCCL picks its own reduction order (rings, trees), so unlike the process group
//! a shard is not promised to be bitwise what `ncclAllReduce` gives.

use std::sync::Arc;

use cudarc::driver::DevicePtrMut;
use cudarc::driver::sys::CUdeviceptr;

use super::NcclGroup;
use crate::element::{NcclElement, nccl_op};
use crate::result;
use ddp_comm::ReduceOp;
use ddp_comm::error::{CommError, Result};

impl NcclGroup {
    /// Reduces `buf` across ranks leaving on each rank its own shard reduced: `buf` holds one
    /// shard per rank in rank order, rank `p`'s of `counts[p]` elements (adding up to
    /// `buf.len()`, the same on every rank; NCCL cannot check that, a mismatch ends in the
    /// watchdog's timeout). The rest of `buf` is unspecified afterwards.
    ///
    /// # Errors
    /// [`CommError::InvalidArgument`] for sizes that do not fit (the group stays usable); any
    /// NCCL or CUDA failure (the group is then broken).
    pub fn reduce_scatter<T: NcclElement, B: DevicePtrMut<T>>(
        &mut self,
        buf: &mut B,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        self.check_buffer(buf.stream(), "reduce_scatter")?;
        let len = buf.len();
        let stream = Arc::clone(&self.stream);
        let (ptr, _record) = buf.device_ptr_mut(&stream);
        // SAFETY: `ptr` holds `len` elements of T on this group's device, borrowed mutably
        // until the call completed (the collective waits).
        unsafe { self.reduce_scatter_raw::<T>(ptr, len, counts, op) }
    }

    /// [`Self::reduce_scatter`] on memory owned elsewhere (e.g. a Burn/CubeCL CUDA tensor).
    ///
    /// # Safety
    /// As for [`NcclGroup::all_reduce_raw`]: `ptr` addresses `len` elements of `T` on this
    /// group's device, valid and untouched by other work until this returns.
    pub unsafe fn reduce_scatter_raw<T: NcclElement>(
        &mut self,
        ptr: CUdeviceptr,
        len: usize,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        let starts = self.shard_starts(counts, len, "reduce_scatter")?;
        let what = format!(
            "reduce_scatter({op:?}, {len} x {} in {} shards)",
            T::NAME,
            counts.len()
        );
        let size = std::mem::size_of::<T>() as CUdeviceptr;
        let red_op = nccl_op(op, self.world_size());
        self.collective("reduce_scatter", &what, |comm, s| {
            grouped(counts, |p, count| {
                let at = (ptr + starts[p] as CUdeviceptr * size) as *mut std::ffi::c_void;
                // SAFETY: shard `p` lies inside the buffer (checked above), per this
                // function's contract.
                unsafe {
                    result::reduce(
                        at,
                        at,
                        count,
                        T::as_nccl_type(),
                        red_op,
                        p as std::ffi::c_int,
                        comm,
                        s,
                    )
                }
            })
        })
    }

    /// Gathers every rank's shard of `buf` into every rank's `buf`: rank `p`'s shard of
    /// `counts[p]` elements (in rank order, adding up to `buf.len()`, the same on every rank)
    /// is its input.
    ///
    /// # Errors
    /// As [`Self::reduce_scatter`].
    pub fn all_gather_into<T: NcclElement, B: DevicePtrMut<T>>(
        &mut self,
        buf: &mut B,
        counts: &[usize],
    ) -> Result<()> {
        self.check_buffer(buf.stream(), "all_gather_into")?;
        let len = buf.len();
        let stream = Arc::clone(&self.stream);
        let (ptr, _record) = buf.device_ptr_mut(&stream);
        // SAFETY: as in `reduce_scatter`.
        unsafe { self.all_gather_into_raw::<T>(ptr, len, counts) }
    }

    /// [`Self::all_gather_into`] on memory owned elsewhere.
    ///
    /// # Safety
    /// As for [`Self::reduce_scatter_raw`].
    pub unsafe fn all_gather_into_raw<T: NcclElement>(
        &mut self,
        ptr: CUdeviceptr,
        len: usize,
        counts: &[usize],
    ) -> Result<()> {
        let starts = self.shard_starts(counts, len, "all_gather_into")?;
        let what = format!(
            "all_gather_into({len} x {} in {} shards)",
            T::NAME,
            counts.len()
        );
        let size = std::mem::size_of::<T>() as CUdeviceptr;
        self.collective("all_gather_into", &what, |comm, s| {
            grouped(counts, |p, count| {
                let at = (ptr + starts[p] as CUdeviceptr * size) as *mut std::ffi::c_void;
                // SAFETY: as in `reduce_scatter_raw`.
                unsafe {
                    result::broadcast(
                        at,
                        at,
                        count,
                        T::as_nccl_type(),
                        p as std::ffi::c_int,
                        comm,
                        s,
                    )
                }
            })
        })
    }

    /// Where each rank's shard starts, after checking `counts` against the world and `len`.
    fn shard_starts(&self, counts: &[usize], len: usize, what: &str) -> Result<Vec<usize>> {
        self.usable()?;
        if counts.len() != self.world_size {
            return Err(CommError::InvalidArgument(format!(
                "{what}: {} shard sizes given for a world of {} ranks (one per rank)",
                counts.len(),
                self.world_size
            )));
        }
        let starts: Vec<usize> = counts
            .iter()
            .scan(0usize, |acc, &c| {
                let at = *acc;
                *acc = acc.saturating_add(c);
                Some(at)
            })
            .collect();
        let total = counts.iter().fold(0usize, |a, &c| a.saturating_add(c));
        if total != len {
            return Err(CommError::InvalidArgument(format!(
                "{what}: the shard sizes add up to {total} elements but the buffer has {len}"
            )));
        }
        Ok(starts)
    }
}

/// Runs `call(rank, count)` for every non-empty shard inside one NCCL group
/// (`ncclGroupStart` … `ncclGroupEnd`, which is always reached once started).
fn grouped(
    counts: &[usize],
    mut call: impl FnMut(usize, usize) -> std::result::Result<result::Progress, result::NcclError>,
) -> std::result::Result<result::Progress, result::NcclError> {
    result::group_start()?;
    let mut first_error = None;
    for (p, &count) in counts.iter().enumerate().filter(|(_, c)| **c > 0) {
        if let Err(e) = call(p, count) {
            first_error.get_or_insert(e);
        }
    }
    // SAFETY: the calls above satisfy their own contracts (the callers').
    let ended = unsafe { result::group_end() };
    match first_error {
        Some(e) => Err(e),
        None => ended,
    }
}
