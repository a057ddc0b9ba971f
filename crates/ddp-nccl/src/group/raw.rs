//! The raw-pointer variants of [`NcclGroup`]'s collectives, for device memory owned by another
//! library (a Burn/CubeCL tensor): each runs the same body as its safe twin.

use cudarc::driver::sys::CUdeviceptr;

use super::NcclGroup;
use crate::element::{NcclElement, nccl_op};
use crate::result;
use ddp_comm::ReduceOp;
use ddp_comm::error::Result;

impl NcclGroup {
    /// [`NcclGroup::all_reduce`] on memory owned elsewhere (e.g. a Burn/CubeCL CUDA tensor).
    ///
    /// # Safety
    /// `ptr` must address `len` elements of `T` in device memory of this group's device, stay
    /// valid and untouched by other work until this returns, and hold its final input: work on
    /// other streams that writes it must be finished or ordered before this group's stream
    /// (see [`NcclGroup::wait_for_stream`]).
    pub unsafe fn all_reduce_raw<T: NcclElement>(
        &mut self,
        ptr: CUdeviceptr,
        len: usize,
        op: ReduceOp,
    ) -> Result<()> {
        let what = format!("all_reduce({op:?}, {len} x {} raw)", T::NAME);
        // SAFETY: per this function's contract.
        unsafe { self.run_all_reduce::<T>("all_reduce", &what, ptr, ptr, len, op) }
    }

    /// [`NcclGroup::all_reduce_raw`] over several buffers at once: one NCCL group call
    /// (`ncclGroupStart` … `ncclGroupEnd`), so NCCL runs the reductions back to back on its
    /// stream and the host waits once for all of them. Every rank must pass the same number of
    /// buffers with the same lengths, in the same order. No buffers: returns at once.
    ///
    /// # Safety
    /// As for [`NcclGroup::all_reduce_raw`], for every `(pointer, length)` pair; the buffers
    /// must not overlap.
    pub unsafe fn all_reduce_many_raw<T: NcclElement>(
        &mut self,
        buffers: &[(CUdeviceptr, usize)],
        op: ReduceOp,
    ) -> Result<()> {
        if buffers.is_empty() {
            return Ok(());
        }
        let total: usize = buffers.iter().map(|&(_, len)| len).sum();
        let what = format!(
            "all_reduce({op:?}, {} buffers, {total} x {} raw)",
            buffers.len(),
            T::NAME
        );
        let red_op = nccl_op(op, self.world_size());
        self.collective("all_reduce", &what, |comm, s| {
            result::group_start()?;
            // Every call between start and end is deferred to `ncclGroupEnd`, which is always
            // reached once the group started.
            let mut first_error = None;
            for &(ptr, len) in buffers {
                // SAFETY: per this function's contract.
                let r = unsafe {
                    result::all_reduce(
                        ptr as *const _,
                        ptr as *mut _,
                        len,
                        T::as_nccl_type(),
                        red_op,
                        comm,
                        s,
                    )
                };
                if let Err(e) = r {
                    first_error.get_or_insert(e);
                }
            }
            // SAFETY: the calls above satisfy their contracts (this function's).
            let ended = unsafe { result::group_end() };
            match first_error {
                Some(e) => Err(e),
                None => ended,
            }
        })
    }

    /// [`NcclGroup::broadcast`] on memory owned elsewhere.
    ///
    /// # Safety
    /// As for [`NcclGroup::all_reduce_raw`].
    pub unsafe fn broadcast_raw<T: NcclElement>(
        &mut self,
        ptr: CUdeviceptr,
        len: usize,
        root: usize,
    ) -> Result<()> {
        self.check_root(root, "broadcast")?;
        let what = format!("broadcast(root {root}, {len} x {} raw)", T::NAME);
        // SAFETY: per this function's contract.
        unsafe { self.run_broadcast::<T>(&what, ptr, len, root) }
    }

    /// [`NcclGroup::all_gather`] on memory owned elsewhere: `input` holds `len` elements,
    /// `output` `len * world_size`.
    ///
    /// # Safety
    /// As for [`NcclGroup::all_reduce_raw`], for both pointers; they must not overlap unless
    /// `input` is this rank's slot of `output` (NCCL's in-place all-gather).
    pub unsafe fn all_gather_raw<T: NcclElement>(
        &mut self,
        input: CUdeviceptr,
        len: usize,
        output: CUdeviceptr,
    ) -> Result<()> {
        let what = format!("all_gather({len} x {} per rank, raw)", T::NAME);
        // SAFETY: per this function's contract.
        unsafe { self.run_all_gather::<T>(&what, input, len, output) }
    }
}
