//! [`NcclGroup`] as a [`Collectives`] implementation: the interface the host group
//! ([`ddp_comm::ProcessGroup`]) implements, on CUDA device memory ([`DeviceBuffer`]).
//!
//! Compression on NCCL is a buffer of 16-bit values: the caller casts on the device (burn-ddp
//! casts its tensors) and NCCL reduces bf16 or fp16 natively, keeping its partial sums in 16
//! bits between ring steps (as PyTorch's compression hooks do). So a call's `compression`
//! must name the element type of its buffer.

use cudarc::driver::sys::CUdeviceptr;
use ddp_comm::error::{CommError, Result};
use ddp_comm::{Collectives, Compression, ReduceOp};

use super::NcclGroup;

/// The element type of a [`DeviceBuffer`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceElement {
    /// 32-bit floats.
    F32,
    /// bfloat16 (what [`Compression::Bf16`] sends).
    Bf16,
    /// IEEE half precision (what [`Compression::Fp16`] sends).
    F16,
}

impl DeviceElement {
    /// The element type `compression` sends.
    pub fn of(compression: Compression) -> DeviceElement {
        match compression {
            Compression::Bf16 => DeviceElement::Bf16,
            Compression::Fp16 => DeviceElement::F16,
            _ => DeviceElement::F32,
        }
    }
}

/// Values in device memory of an [`NcclGroup`]'s device, owned elsewhere (a Burn/CubeCL
/// tensor's buffer): a pointer, a length and an element type.
/// Neither `Clone` nor `Copy`: the one value made by [`DeviceBuffer::from_raw`] is the one the
/// collectives may write through.
#[derive(Debug, PartialEq, Eq)]
pub struct DeviceBuffer {
    ptr: CUdeviceptr,
    len: usize,
    element: DeviceElement,
}

impl DeviceBuffer {
    /// A view of `len` values of `element` at `ptr`.
    ///
    /// # Safety
    /// `ptr` must address `len` values of `element` in device memory of the group's device
    /// that the collectives called with it may read and write, valid and untouched by other
    /// work until they return, with every earlier write to it finished (see
    /// [`NcclGroup::all_reduce_raw`]).
    pub unsafe fn from_raw(ptr: CUdeviceptr, len: usize, element: DeviceElement) -> Self {
        DeviceBuffer { ptr, len, element }
    }

    /// The number of values.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no value.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The element type.
    pub fn element(&self) -> DeviceElement {
        self.element
    }

    /// The buffer's values in `compression`'s element type, or an error naming both.
    fn check(&self, compression: Compression, op: &str) -> Result<()> {
        if self.element == DeviceElement::of(compression) {
            Ok(())
        } else {
            Err(CommError::InvalidArgument(format!(
                "{op} with compression {compression} on a buffer of {:?} values: cast the \
                 values to the compressed type on the device first",
                self.element
            )))
        }
    }
}

impl Collectives for NcclGroup {
    type Buffer = DeviceBuffer;

    fn rank(&self) -> usize {
        NcclGroup::rank(self)
    }

    fn world_size(&self) -> usize {
        NcclGroup::world_size(self)
    }

    fn all_reduce(
        &mut self,
        buf: &mut DeviceBuffer,
        op: ReduceOp,
        compression: Compression,
    ) -> Result<()> {
        self.all_reduce_many(&mut [buf], op, compression)
    }

    /// One NCCL group call for every buffer: NCCL runs the reductions back to back on its
    /// stream and the host waits once.
    fn all_reduce_many(
        &mut self,
        bufs: &mut [&mut DeviceBuffer],
        op: ReduceOp,
        compression: Compression,
    ) -> Result<()> {
        for b in bufs.iter() {
            b.check(compression, "all_reduce")?;
        }
        let pairs: Vec<(CUdeviceptr, usize)> = bufs.iter().map(|b| (b.ptr, b.len)).collect();
        let g = self;
        // SAFETY: every buffer was made by `DeviceBuffer::from_raw`, whose contract is the raw
        // call's.
        unsafe {
            match DeviceElement::of(compression) {
                DeviceElement::F32 => g.all_reduce_many_raw::<f32>(&pairs, op),
                DeviceElement::Bf16 => g.all_reduce_many_raw::<half::bf16>(&pairs, op),
                DeviceElement::F16 => g.all_reduce_many_raw::<half::f16>(&pairs, op),
            }
        }
    }

    fn reduce_scatter(
        &mut self,
        buf: &mut DeviceBuffer,
        counts: &[usize],
        op: ReduceOp,
        compression: Compression,
    ) -> Result<()> {
        buf.check(compression, "reduce_scatter")?;
        let g = self;
        // SAFETY: as in `all_reduce_many`.
        unsafe {
            match buf.element {
                DeviceElement::F32 => g.reduce_scatter_raw::<f32>(buf.ptr, buf.len, counts, op),
                DeviceElement::Bf16 => {
                    g.reduce_scatter_raw::<half::bf16>(buf.ptr, buf.len, counts, op)
                }
                DeviceElement::F16 => {
                    g.reduce_scatter_raw::<half::f16>(buf.ptr, buf.len, counts, op)
                }
            }
        }
    }

    /// Equal shards (SyncBatchNorm's statistics) as one in-place `ncclAllGather`; shards of
    /// other sizes as grouped `ncclBroadcast` calls.
    fn all_gather_into(&mut self, buf: &mut DeviceBuffer, counts: &[usize]) -> Result<()> {
        let g = self;
        // SAFETY: as in `all_reduce_many`.
        unsafe {
            match buf.element {
                DeviceElement::F32 => gather::<f32>(g, buf, counts),
                DeviceElement::Bf16 => gather::<half::bf16>(g, buf, counts),
                DeviceElement::F16 => gather::<half::f16>(g, buf, counts),
            }
        }
    }

    fn broadcast(&mut self, buf: &mut DeviceBuffer, root: usize) -> Result<()> {
        let g = self;
        // SAFETY: as in `all_reduce_many`.
        unsafe {
            match buf.element {
                DeviceElement::F32 => g.broadcast_raw::<f32>(buf.ptr, buf.len, root),
                DeviceElement::Bf16 => g.broadcast_raw::<half::bf16>(buf.ptr, buf.len, root),
                DeviceElement::F16 => g.broadcast_raw::<half::f16>(buf.ptr, buf.len, root),
            }
        }
    }

    fn barrier(&mut self) -> Result<()> {
        NcclGroup::barrier(self)
    }
}

/// [`Collectives::all_gather_into`] of `buf`'s values as `T`.
///
/// # Safety
/// As [`DeviceBuffer::from_raw`], with `T` the buffer's element type.
unsafe fn gather<T: crate::NcclElement>(
    g: &mut NcclGroup,
    buf: &DeviceBuffer,
    counts: &[usize],
) -> Result<()> {
    let n = g.world_size();
    let each = counts.first().copied().unwrap_or(0);
    let equal =
        counts.len() == n && each > 0 && counts.iter().all(|&c| c == each) && each * n == buf.len;
    if equal {
        let mine = buf.ptr + (g.rank() * each * std::mem::size_of::<T>()) as CUdeviceptr;
        // SAFETY: `mine` is this rank's slot of the buffer (NCCL's in-place all-gather), per
        // this function's contract.
        unsafe { g.all_gather_raw::<T>(mine, each, buf.ptr) }
    } else {
        // SAFETY: per this function's contract.
        unsafe { g.all_gather_into_raw::<T>(buf.ptr, buf.len, counts) }
    }
}
